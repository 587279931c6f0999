"""Peers from other projects without installing them: their venv recipe, launch commands and
what the bench writes about them, with a fake peer standing in for a real server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lenbatch.replay.bench import BenchConfig, run_bench
from lenbatch.replay.driver import ReplayPlan
from lenbatch.replay.endpoints import EmbeddingsEndpoint
from lenbatch.replay.peers.external import PeerContext, PeerLaunch, PeerVenv, VenvSpec
from lenbatch.replay.peers.infinity import INFINITY, INFINITY_BF16
from lenbatch.replay.peers.llamacpp import LLAMACPP, cpu_has_amx
from lenbatch.replay.peers.registry import EXTERNAL_PEERS, external_peer
from lenbatch.replay.peers.vllm import VLLM, VLLM_ALL_CORES, VLLM_BF16
from lenbatch.replay.targets import Target, prepare_target, targets_for

FAKE_SERVER = Path(__file__).with_name("fake_peer_server.py")


class Recorder:
    """Stands in for subprocess.run: records each command, answers the version queries."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        self.calls.append(list(cmd))
        out = ""
        if "-c" in cmd and "importlib.metadata" in cmd[cmd.index("-c") + 1]:
            out = json.dumps({d: "9.9" for d in cmd[cmd.index("-c") + 2 :]})
        elif "-c" in cmd:
            out = "3.11.7\n"
        if cmd[1:3] == ["-m", "venv"]:
            (Path(cmd[-1]) / "bin").mkdir(parents=True, exist_ok=True)
        return subprocess.CompletedProcess(cmd, 0, stdout=out, stderr="")


def test_every_peer_is_pinned_exactly_with_torch_in_the_same_command() -> None:
    """Exact pins only; torch==2.13.0 in the one pip command of each torch-based peer."""
    for name in EXTERNAL_PEERS:
        spec = external_peer(name).venv
        assert all("==" in r for r in spec.requirements), name
    assert "torch==2.13.0" in INFINITY.venv.requirements
    assert "torch==2.13.0" in VLLM.venv.requirements
    assert set(VLLM.venv.uninstall) == {"torchvision", "torchaudio", "torchcodec"}


def test_venv_is_made_once_and_remade_when_the_pins_change(tmp_path: Path) -> None:
    """First use: venv, one pip command with every pin, the uninstalls, a stamp with versions
    and disk size. Second use: nothing runs. Other pins: installed again."""
    spec = VenvSpec("p", ("torch==2.13.0", "peer==1.0"), ("junk",), ("peer",))
    run = Recorder()
    record = PeerVenv(spec, tmp_path).ensure(log=lambda _: None, run=run)
    pip = [c for c in run.calls if "pip" in c]
    assert pip[0][-2:] == ["torch==2.13.0", "peer==1.0"] and pip[0][:1] == [
        str(tmp_path / "p" / "bin" / "python")
    ]
    assert pip[1][-1] == "junk" and "uninstall" in pip[1]
    assert record["versions"] == {"peer": "9.9"} and record["python"] == "3.11.7"
    assert record["disk_mb"] >= 0 and record["install_s"] >= 0
    again = Recorder()
    assert PeerVenv(spec, tmp_path).ensure(log=lambda _: None, run=again) == record
    assert again.calls == []
    bumped = VenvSpec("p", ("torch==2.13.0", "peer==2.0"))
    PeerVenv(bumped, tmp_path).ensure(log=lambda _: None, run=again)
    assert any(c[-1] == "peer==2.0" for c in again.calls)


def _ctx(
    tmp_path: Path, endpoint: str = "embeddings", cpus: int = 2, model: str = "minilm"
) -> PeerContext:
    venv = tmp_path / "v"
    (venv / "lib").mkdir(parents=True, exist_ok=True)
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    return PeerContext(model, endpoint, 16, venv / "bin" / "python", venv, cpus)


def _arg(argv: tuple[str, ...], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_infinity_launch_serves_openai_route_offline_with_the_bench_batch(tmp_path: Path) -> None:
    """Loopback, /v1 prefix, mean pooling, no compile, the bench's batch cap."""
    launch = INFINITY.launch(_ctx(tmp_path))
    argv = launch.argv
    assert argv[1] == "v2" and _arg(argv, "--host") == "127.0.0.1"
    assert _arg(argv, "--port") == "{port}" and _arg(argv, "--url-prefix") == "/v1"
    assert _arg(argv, "--pooling-method") == "mean" and "--no-compile" in argv
    assert _arg(argv, "--batch-size") == "16" and _arg(argv, "--engine") == "torch"
    assert Path(_arg(argv, "--model-id"), "config.json").exists()
    assert _arg(argv, "--dtype") == "float32"


def test_infinity_bf16_is_the_same_server_in_bfloat16_from_the_same_venv(tmp_path: Path) -> None:
    """`infinity-bf16`: registered, one venv with `infinity`, only the dtype differs."""
    assert external_peer("infinity-bf16") is INFINITY_BF16
    assert INFINITY_BF16.venv == INFINITY.venv
    plain, bf16 = INFINITY.launch(_ctx(tmp_path)).argv, INFINITY_BF16.launch(_ctx(tmp_path)).argv
    assert _arg(bf16, "--dtype") == "bfloat16"
    i = plain.index("--dtype") + 1
    assert bf16[:i] + bf16[i + 1 :] == plain[:i] + plain[i + 1 :]


def test_vllm_launch_default_binding_and_all_cores(tmp_path: Path) -> None:
    """Pooling runner capped at 256 tokens, the venv's libiomp5 preloaded; `vllm-allcores`
    binds the model's threads to every core, `vllm` leaves vLLM's default."""
    ctx = _ctx(tmp_path)
    one = VLLM.launch(ctx)
    assert one.argv[1:3] == ("-m", "vllm.entrypoints.openai.api_server")
    assert _arg(one.argv, "--runner") == "pooling" and _arg(one.argv, "--max-model-len") == "256"
    assert _arg(one.argv, "--host") == "127.0.0.1" and _arg(one.argv, "--max-num-seqs") == "16"
    assert str(ctx.venv / "lib" / "libiomp5.so") in one.env["LD_PRELOAD"].split(":")
    assert one.env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in one.env
    both = VLLM_ALL_CORES.launch(ctx)
    assert both.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert any("0-1" in n for n in both.notes)
    assert _arg(one.argv, "--dtype") == _arg(both.argv, "--dtype") == "float32"
    bf16 = VLLM_BF16.launch(ctx)
    assert _arg(bf16.argv, "--dtype") == "bfloat16"
    assert bf16.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"


def test_llamacpp_serves_the_gguf_file_on_loopback(tmp_path: Path) -> None:
    """The GGUF file itself, every core, loopback; health on /v1/models; embeddings refused."""
    ctx = _ctx(tmp_path, "completions", model="smollm2")
    launch = LLAMACPP.launch(ctx)
    assert _arg(launch.argv, "--model").endswith(".gguf")
    assert Path(_arg(launch.argv, "--model")).is_file()
    assert _arg(launch.argv, "--host") == "127.0.0.1" and _arg(launch.argv, "--n_threads") == "2"
    assert launch.health_path == "/v1/models"
    target = targets_for([], ["llamacpp"])[0]
    with pytest.raises(ValueError, match="serves completions, not embeddings"):
        prepare_target(target, model="smollm2", endpoint="embeddings", max_batch=8)


def test_amx_is_read_from_cpu_flags() -> None:
    """Only a CPU that lists amx_tile counts as having AMX."""
    assert cpu_has_amx("flags\t\t: fpu avx512f amx_bf16 amx_tile amx_int8\n")
    assert not cpu_has_amx("flags\t\t: fpu avx512f avx512_bf16\n")


class FakePeer:
    """An `ExternalPeer` whose server is tests/unit/fake_peer_server.py."""

    name = "fake"
    endpoints = ("embeddings",)
    venv = VenvSpec("fake", ("fake-peer==1.0",), report_versions=("fake-peer",))

    def launch(self, ctx: PeerContext) -> PeerLaunch:
        argv = (sys.executable, str(FAKE_SERVER), "--port", "{port}")
        return PeerLaunch(argv, {"FAKE_PEER_TOKEN": "ok"}, "/ready", ("fake flag note",))


@pytest.mark.slow
def test_bench_launches_a_fake_peer_and_reports_its_setup(tmp_path: Path) -> None:
    """The peer's venv record, command, environment and notes reach the report; its own
    health path is used; its environment is passed (the fake answers 500 otherwise); two
    rates replay the same requests on one server start; the server is gone afterwards."""
    root = tmp_path / "peers"
    (root / "fake").mkdir(parents=True)
    stamp = {"requirements": ["fake-peer==1.0"], "uninstalled": [], "install_s": 12.5,
             "disk_mb": 321, "versions": {"fake-peer": "1.0"}, "python": "3.11.7"}  # fmt: skip
    (root / "fake" / "lenbatch-peer.json").write_text(json.dumps(stamp))
    target = prepare_target(
        Target("fake", "peer", (), external=FakePeer()),
        model="minilm", endpoint="embeddings", max_batch=8, log=lambda _: None, root=root,
    )  # fmt: skip
    assert dict(target.env)["HF_HUB_OFFLINE"] == "1" and dict(target.env)["DO_NOT_TRACK"] == "1"
    body = EmbeddingsEndpoint().body("hello")
    plan = ReplayPlan(
        scheduled=np.linspace(0, 0.5, 6), lengths=np.full(6, 3), bodies=[body] * 6, span_s=1.0
    )
    cfg = BenchConfig(
        plan=plan, endpoint=EmbeddingsEndpoint(), targets=[target], report_dir=tmp_path / "r",
        rates=(1.0, 2.0), warmup=[body], meta={"title": "fake"}, progress=False,
        keep_server=True,
    )  # fmt: skip
    text = run_bench(cfg, log=lambda _: None).read_text()
    runs = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "r" / "runs").glob("*.json")}
    assert set(runs) == {"fake", "fake@x2"}
    for run in runs.values():
        assert run["summary"]["completed"] == 6, run["result"]["errors"]
        assert run["env"]["FAKE_PEER_TOKEN"] == "ok"
        assert run["peer"]["versions"] == {"fake-peer": "1.0"}
        with pytest.raises(ProcessLookupError):
            import os

            os.kill(run["pid"], 0)
    assert runs["fake@x2"]["summary"]["offered_rps"] == pytest.approx(12.0)
    assert runs["fake"]["pid"] == runs["fake@x2"]["pid"]  # --keep-server: one start
    assert "## Peers from other projects" in text and "fake-peer 1.0" in text
    assert "12.5 s, 321 MB on disk" in text and "fake flag note" in text
    assert "`FAKE_PEER_TOKEN=ok`" in text and str(FAKE_SERVER) in text
    head = text.split("## Headline", 1)[1].split("## Results", 1)[0]
    assert "| fake | x2 (12.0 req/s) |" in head


def test_llamacpp_turns_extra_buffer_types_off_only_with_amx(tmp_path: Path) -> None:
    """With AMX the server starts through the wrapper that sets use_extra_bufts = False."""
    from lenbatch.replay.peers.llamacpp import NO_EXTRA_BUFTS, LlamaCppPeer

    ctx = _ctx(tmp_path, "completions", model="smollm2")
    amx = LlamaCppPeer(amx=True).launch(ctx)
    assert amx.argv[1:3] == ("-c", NO_EXTRA_BUFTS) and "use_extra_bufts = False" in amx.argv[2]
    assert "--model" in amx.argv and any("AMX" in n for n in amx.notes)
    assert LlamaCppPeer(amx=False).launch(ctx).argv[1:3] == ("-m", "llama_cpp.server")
    compile(NO_EXTRA_BUFTS, "<wrapper>", "exec")
