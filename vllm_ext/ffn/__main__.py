"""`python -m vllm_ext.ffn MODEL --afd-controller HOST:PORT [vLLM flags]`: an FFN server without
the `vllm` command (the same as `vllm serve MODEL --afd-role ffn ...`; vllm_ext.ffn.cli)."""

from __future__ import annotations

from vllm_ext.ffn.cli import serve_ffn


def main(argv: list[str] | None = None) -> None:
    import vllm_ext
    from vllm_ext import compat

    vllm_ext.register()
    seams = compat.seams()
    _, async_engine_args = seams.engine_args_classes()
    parser = seams.flexible_argument_parser()(
        description="AFD FFN worker (same flags as vllm serve)"
    )
    parser.add_argument("model")
    parser = async_engine_args.add_cli_args(parser)
    args = parser.parse_args(argv)
    if args.afd_role is None:
        args.afd_role = "ffn"
    from vllm_ext import startup_errors
    from vllm_ext.config import AfdConfig, afd_section
    from vllm_ext.hooks import merge_afd_flags

    try:  # a bad --afd-* flag: one argparse-style line, as `vllm serve` says it
        AfdConfig.resolve(afd_section(merge_afd_flags(args.additional_config, args)))
    except ValueError as exc:
        startup_errors.flag_error(exc, "python -m vllm_ext.ffn")
    with startup_errors.said_last():
        serve_ffn(args)


if __name__ == "__main__":
    main()
