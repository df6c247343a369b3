"""The OpenAI-API router in front of prefill/decode disaggregation (PD) with an AFD decode side.

    python -m vllm_ext.pd_router --prefill http://P1:8100 [--prefill http://P2:8100] \\
        --decode http://ATTENTION:8200 --port 8000

Each completion or chat request runs twice, the way vLLM's own disaggregated proxy does it:
1. on a prefill server (`vllm serve --kv-transfer-config` as KV producer) with `max_tokens` 1,
   no stream, and `kv_transfer_params` {"do_remote_decode": true}: it computes the prompt's KV
   cache and keeps it for the decode side, answering where to read it (its kv_transfer_params);
2. on the decode server (the AFD attention server, KV consumer) with those kv_transfer_params:
   its KV connector reads the prompt's KV cache instead of computing it, and it decodes. Its
   answer, streamed or not, error or not, goes back to the client unchanged.
Both calls carry the same X-Request-Id (vLLM's connectors match the two halves by it).

vLLM keeps its proxy in its examples and tests, not in the wheel: this is the small one a
deployment runs. It needs aiohttp, which vLLM itself depends on. Every wait has a bound: a
prefill server that is down or fails is skipped for the next one (nothing ran on it for this
request); when none answers, the request gets a 503 naming each and what it said, and the
decode side never sees it. The decode server's own errors (a 503 while its FFN side is down)
pass through as it sent them.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

log = logging.getLogger("vllm_ext.pd_router")

ROUTES = ("/v1/completions", "/v1/chat/completions")
HEALTH_TIMEOUT_S = 2.0
# What vLLM's proxy sends a prefill server: "compute the prompt, keep its KV for a decode side".
PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# Sampling settings the one-token prefill request must not carry (vLLM's proxy drops them too).
NOT_FOR_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens")


@dataclass(frozen=True)
class RouterConfig:
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    connect_timeout_s: float = 5.0
    # Bound on each read from a server: a prefill's whole answer, or the gap between two chunks
    # of a decode stream.
    read_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.prefill_urls or not self.decode_urls:
            raise ValueError("give at least one --prefill URL and one --decode URL")
        for url in (*self.prefill_urls, *self.decode_urls):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{url!r} is not a URL: write it as http://HOST:PORT")
        if self.connect_timeout_s <= 0 or self.read_timeout_s <= 0:
            raise ValueError("--connect-timeout-s and --read-timeout-s must be > 0")


class BackendFailed(Exception):
    """A server could not take the request (down, or answered 5xx): try another one."""


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request as the prefill server runs it: one token, no stream, KV kept for decode."""
    prefill = {k: v for k, v in body.items() if k not in NOT_FOR_PREFILL}
    prefill.update(stream=False, max_tokens=1, kv_transfer_params=dict(PREFILL_KV_PARAMS))
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    return prefill


def decode_body(body: dict[str, Any], prefill_answer: dict[str, Any]) -> dict[str, Any]:
    """The client's request with the prefill server's kv_transfer_params (where its KV is). A
    connector that finds the KV by the prompt itself (a shared store) answers none."""
    params = prefill_answer.get("kv_transfer_params")
    return {**body, "kv_transfer_params": params} if params else dict(body)


def error_response(status: int, message: str) -> web.Response:
    """An error in the OpenAI server's shape (what vLLM itself answers)."""
    kind = "ServiceUnavailableError" if status == 503 else "BadGatewayError"
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(body, status=status)


def stream_error_event(message: str) -> bytes:
    """A stream that broke after its first bytes ends with an error event, as vLLM's do."""
    error = {"message": message, "type": "ServiceUnavailableError", "param": None, "code": 503}
    return f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n".encode()


class PdRouter:
    """Routes each request to a prefill server, then to a decode server (round robin)."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._prefill_turn = itertools.cycle(range(len(config.prefill_urls)))
        self._decode_turn = itertools.cycle(range(len(config.decode_urls)))
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            timeout = aiohttp.ClientTimeout(
                total=None,
                connect=self.config.connect_timeout_s,
                sock_read=self.config.read_timeout_s,
            )
            self._session = aiohttp.ClientSession(timeout=timeout)
        return self._session

    def app(self) -> web.Application:
        app = web.Application()
        for route in ROUTES:
            app.router.add_post(route, self.handle_generate)
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/v1/models", self.handle_models)
        app.on_cleanup.append(self._close)
        return app

    async def _close(self, _app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    async def handle_generate(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError as exc:
            return error_response(400, f"the request body is not JSON: {exc}")
        headers = {"X-Request-Id": request.headers.get("X-Request-Id") or uuid.uuid4().hex}
        if "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        answered = await self._prefill(request.path, body, headers)
        if isinstance(answered, web.Response):
            return answered
        return await self._decode(request, decode_body(body, answered), headers)

    async def _prefill(
        self, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> dict[str, Any] | web.Response:
        """The prefill server's JSON answer, its 4xx as is (the request itself is wrong), or
        a 503 when no prefill server could take it."""
        failures = []
        first = next(self._prefill_turn)
        urls = self.config.prefill_urls
        for url in urls[first:] + urls[:first]:
            try:
                async with self.session.post(
                    url + path, json=prefill_body(body), headers=headers
                ) as reply:
                    text = await reply.text()
                    if reply.status >= 500:
                        raise BackendFailed(f"answered {reply.status}: {text[:300]}")
                    if reply.status >= 400:
                        return web.Response(
                            status=reply.status, text=text, content_type="application/json"
                        )
                    return dict(json.loads(text))
            except (aiohttp.ClientError, TimeoutError, BackendFailed, ValueError) as exc:
                failures.append(f"{url}: {_describe(exc)}")
                log.warning("pd router: prefill server %s failed: %s", url, _describe(exc))
        return error_response(
            503,
            "no prefill server could run the request's prompt ("
            + "; ".join(failures)
            + "); it did not reach the decode server. Retry once a prefill server is up.",
        )

    async def _decode(
        self, request: web.Request, body: dict[str, Any], headers: dict[str, str]
    ) -> web.StreamResponse:
        url = self.config.decode_urls[next(self._decode_turn)]
        try:
            async with self.session.post(url + request.path, json=body, headers=headers) as reply:
                if not body.get("stream") or reply.status != 200:
                    return web.Response(
                        status=reply.status,
                        body=await reply.read(),
                        content_type=reply.content_type,
                    )
                return await self._stream(request, reply, url)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("pd router: decode server %s failed: %s", url, _describe(exc))
            return error_response(
                503,
                f"the decode server {url} could not run the request ({_describe(exc)}). "
                "Retry once its GET /health returns 200.",
            )

    async def _stream(
        self, request: web.Request, reply: aiohttp.ClientResponse, url: str
    ) -> web.StreamResponse:
        out = web.StreamResponse(status=200, headers={"Content-Type": reply.content_type})
        await out.prepare(request)
        try:
            async for chunk in reply.content.iter_any():
                await out.write(chunk)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("pd router: decode stream from %s broke: %s", url, _describe(exc))
            await out.write(
                stream_error_event(f"the decode server {url} stopped mid-stream: {_describe(exc)}")
            )
        await out.write_eof()
        return out

    async def handle_health(self, _request: web.Request) -> web.Response:
        """200 while at least one prefill and one decode server answer their /health."""
        urls = (*self.config.prefill_urls, *self.config.decode_urls)
        states = await asyncio.gather(*(self._health_of(url) for url in urls))
        status = dict(zip(urls, states, strict=True))
        prefill_up = any(status[u] == "ok" for u in self.config.prefill_urls)
        decode_up = any(status[u] == "ok" for u in self.config.decode_urls)
        code = 200 if prefill_up and decode_up else 503
        return web.json_response(
            {
                "prefill": {u: status[u] for u in self.config.prefill_urls},
                "decode": {u: status[u] for u in self.config.decode_urls},
            },
            status=code,
        )

    async def _health_of(self, url: str) -> str:
        try:
            timeout = aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
            async with self.session.get(url + "/health", timeout=timeout) as reply:
                return "ok" if reply.status == 200 else f"answered {reply.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            return _describe(exc)

    async def handle_models(self, _request: web.Request) -> web.Response:
        url = self.config.decode_urls[0]
        try:
            async with self.session.get(url + "/v1/models") as reply:
                return web.Response(
                    status=reply.status, body=await reply.read(), content_type=reply.content_type
                )
        except (aiohttp.ClientError, TimeoutError) as exc:
            return error_response(503, f"the decode server {url} is unreachable: {_describe(exc)}")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "no answer within the router's timeout"
    return str(exc) or type(exc).__name__


def parse_args(argv: list[str] | None = None) -> RouterConfig:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_ext.pd_router",
        description="OpenAI-API router for prefill/decode disaggregation: prefill, then decode",
    )
    parser.add_argument(
        "--prefill",
        action="append",
        required=True,
        metavar="URL",
        help="a prefill server (vllm serve --kv-transfer-config, KV producer); repeat for more",
    )
    parser.add_argument(
        "--decode",
        action="append",
        required=True,
        metavar="URL",
        help="a decode server (the AFD attention server, KV consumer); repeat for more",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--connect-timeout-s", type=float, default=5.0)
    parser.add_argument(
        "--read-timeout-s",
        type=float,
        default=600.0,
        help="bound on a prefill answer and on the gap between two chunks of a decode stream",
    )
    args = parser.parse_args(argv)
    try:
        return RouterConfig(
            prefill_urls=tuple(u.rstrip("/") for u in args.prefill),
            decode_urls=tuple(u.rstrip("/") for u in args.decode),
            host=args.host,
            port=args.port,
            connect_timeout_s=args.connect_timeout_s,
            read_timeout_s=args.read_timeout_s,
        )
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


async def serve(config: RouterConfig) -> None:
    """Runs until SIGTERM or SIGINT; logs the address it listens on (port 0: one picked)."""
    import signal

    runner = web.AppRunner(PdRouter(config).app(), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, config.host, config.port).start()
    except OSError as exc:
        await runner.cleanup()
        raise SystemExit(f"error: cannot listen on {config.host}:{config.port}: {exc}") from None
    host, port = runner.addresses[0][:2]
    log.info(
        "pd router listening on http://%s:%d: prefill %s, decode %s",
        host,
        port,
        ", ".join(config.prefill_urls),
        ", ".join(config.decode_urls),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        log.info("pd router stopped")


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    asyncio.run(serve(parse_args(argv)))


if __name__ == "__main__":
    main()
