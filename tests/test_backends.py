"""Device/backend probe (device_agents/backends.py) against real llama.cpp builds.

* CPU probe: the llama-cpp-python installed in this interpreter.
* Vulkan: the wheel built by ``native/build_llama_wheel.sh vulkan`` into
  build/wheelhouse/<ver>-vulkan/, installed (once) with ``pip install --no-deps
  --target build/vulkan-site`` and put first on PYTHONPATH of subprocesses —
  unless this interpreter's llama_cpp already is the Vulkan variant. The Mesa
  lavapipe (llvmpipe) driver provides a CPU-type Vulkan device.

Vulkan tests skip when the wheel or a Vulkan driver is missing, and fail instead
when CANCELBENCH_REQUIRE_VULKAN=1. No wall-clock bounds are asserted anywhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cancelbench.device_agents import backends  # noqa: E402
from cancelbench.device_agents.backends import BackendDevice  # noqa: E402

LLAMA_VERSION = "0.3.36"
REQUIRE_VULKAN = os.environ.get("CANCELBENCH_REQUIRE_VULKAN") == "1"


def _unavailable(reason: str):
    if REQUIRE_VULKAN:
        pytest.fail(f"CANCELBENCH_REQUIRE_VULKAN=1 but {reason}")
    pytest.skip(reason)


# --------------------------------------------------------------------------- pure helpers

def test_parse_device_id():
    assert backends.parse_device_id("vulkan:1") == ("vulkan", 1)
    assert backends.parse_device_id("cpu") == ("cpu", 0)
    for bad in ("tpu:0", "cuda:x", "vulkan:-1"):
        with pytest.raises(ValueError):
            backends.parse_device_id(bad)


def test_backend_env():
    # set-but-empty GGML_VK_VISIBLE_DEVICES is what makes ggml-vulkan select no device
    assert backends.backend_env("cpu:0") == {"GGML_VK_VISIBLE_DEVICES": "", "CUDA_VISIBLE_DEVICES": ""}
    assert backends.backend_env("vulkan:2")["GGML_VK_VISIBLE_DEVICES"] == "2"
    assert backends.backend_env("cuda:1") == {"CUDA_VISIBLE_DEVICES": "1", "GGML_VK_VISIBLE_DEVICES": ""}
    assert backends.backend_env("metal:0") == {}


def _params_for(device_id: str) -> dict:
    """llama.cpp model/context parameters for a device, given backends.backend_env: with the
    environment restricted to one accelerator it is ggml's device 0 and nothing is split."""
    backend, _ = backends.parse_device_id(device_id)
    gpu = backend != "cpu"
    return {"n_gpu_layers": -1 if gpu else 0, "op_offload": gpu, "offload_kqv": gpu, "main_gpu": 0,
            "split_mode": 0}  # LLAMA_SPLIT_MODE_NONE


def test_which_wheel_variant_from_libs(tmp_path):
    assert backends.which_wheel_variant(tmp_path) == "cpu"
    (tmp_path / "libggml-vulkan.so").write_bytes(b"")
    assert backends.which_wheel_variant(tmp_path) == "vulkan"


# --------------------------------------------------------------------------- installed wheel

def test_cpu_device_probe_in_process():
    devices = backends.probe_devices()
    assert all(isinstance(d, BackendDevice) for d in devices)
    cpu = [d for d in devices if d.device_id == "cpu:0"]
    assert len(cpu) == 1
    c = cpu[0]
    assert (c.backend, c.index, c.type) == ("cpu", 0, "cpu")
    assert c.name == "CPU" and c.registry == "CPU"
    assert c.description  # CPU model string
    assert c.memory_total > 0 and 0 <= c.memory_free <= c.memory_total
    ids = [d.device_id for d in devices]
    assert len(ids) == len(set(ids))


def test_cpu_probe_subprocess_and_build_info():
    payload = backends.probe_devices_subprocess(backends.backend_env("cpu:0"))
    devs = backends.devices_from_payload(payload)
    assert [d.device_id for d in devs] == ["cpu:0"]  # everything else hidden
    build = payload["build"]
    assert build["variant"] == backends.which_wheel_variant()
    assert build["llama_cpp_python"] == LLAMA_VERSION
    assert build["ggml_version"] and build["llama_version"] and build["ggml_commit"]
    info = backends.llama_cpp_build_info()
    assert build["ggml_version"] in info and build["variant"] in info


def test_probe_subprocess_reports_failure():
    with pytest.raises(backends.BackendProbeError):
        backends.probe_devices_subprocess({"LLAMA_CPP_LIB_PATH": "/nonexistent-cancelbench"})


# --------------------------------------------------------------------------- Vulkan fixtures

def _wheel(variant: str) -> Path | None:
    wheels = sorted((ROOT / "build" / "wheelhouse" / f"{LLAMA_VERSION}-{variant}").glob(
        f"llama_cpp_python-{LLAMA_VERSION}-*.whl"))
    return wheels[-1] if wheels else None


def _site_for(variant: str) -> dict[str, str] | None:
    """Env overlay that makes a subprocess import the given variant; None if unavailable.
    {} when this interpreter's llama_cpp already is that variant."""
    try:
        if backends.which_wheel_variant() == variant:
            return {}
    except backends.BackendProbeError:
        pass
    wheel = _wheel(variant)
    if wheel is None:
        return None
    site = ROOT / "build" / f"{variant}-site"
    stamp = site / ".cancelbench-wheel"
    if not stamp.exists() or stamp.read_text() != f"{wheel.name} {wheel.stat().st_mtime_ns}":
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade",
                        "--target", str(site), str(wheel)], check=True)
        stamp.write_text(f"{wheel.name} {wheel.stat().st_mtime_ns}")
    pp = os.pathsep.join([str(site), str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    return {"PYTHONPATH": pp}


@pytest.fixture(scope="module")
def vulkan_site() -> dict[str, str]:
    env = _site_for("vulkan")
    if env is None:
        _unavailable(f"no Vulkan wheel in build/wheelhouse/{LLAMA_VERSION}-vulkan "
                     "(run native/build_llama_wheel.sh vulkan)")
    return env


@pytest.fixture(scope="module")
def lavapipe_index(vulkan_site) -> int:
    phys = backends.vulkan_physical_devices()
    cpu_type = [p["index"] for p in phys if p["vk_type"] == "cpu"]
    if not cpu_type:
        _unavailable(f"no CPU-type Vulkan device (lavapipe; apt-get install mesa-vulkan-drivers "
                     f"libvulkan1); physical devices: {phys}")
    return cpu_type[0]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    from cancelbench.datasets.fixtures import TextFixtureSpec, write_text_fixture

    spec = TextFixtureSpec("tiny-backends-llama", "llama", n_embd=64, n_layer=2, n_head=4, n_head_kv=2,
                           n_ff=128, n_ctx_train=512, seed=7)
    return write_text_fixture(spec, tmp_path_factory.mktemp("gguf"))


# --------------------------------------------------------------------------- Vulkan probe

def test_vulkan_wheel_variant(vulkan_site):
    payload = backends.probe_devices_subprocess({**vulkan_site, "GGML_VK_VISIBLE_DEVICES": ""})
    assert payload["build"]["variant"] == "vulkan"
    assert Path(payload["lib_dir"], "libggml-vulkan.so").exists()


def test_lavapipe_listed_with_visible_devices(vulkan_site, lavapipe_index):
    env = {**vulkan_site, **backends.backend_env(f"vulkan:{lavapipe_index}")}
    devs = backends.devices_from_payload(backends.probe_devices_subprocess(env))
    by_id = {d.device_id: d for d in devs}
    assert "cpu:0" in by_id
    vk = by_id.get(f"vulkan:{lavapipe_index}")
    assert vk is not None, devs
    assert vk.backend == "vulkan" and vk.registry == "Vulkan" and vk.name.startswith("Vulkan")
    assert "llvmpipe" in vk.description.lower()
    assert vk.type in ("gpu", "igpu")
    assert vk.memory_total > 0
    assert [d for d in devs if d.backend == "vulkan"] == [vk]


def test_lavapipe_hidden_without_env(vulkan_site, lavapipe_index):
    devs = backends.devices_from_payload(
        backends.probe_devices_subprocess({**vulkan_site, "GGML_VK_VISIBLE_DEVICES": None}))
    # without the variable ggml-vulkan only picks discrete/integrated GPUs
    assert not any("llvmpipe" in d.description.lower() for d in devs if d.backend == "vulkan")
    assert "cpu:0" in {d.device_id for d in devs}


def test_cpu_env_hides_all_vulkan_devices(vulkan_site, lavapipe_index):
    devs = backends.devices_from_payload(
        backends.probe_devices_subprocess({**vulkan_site, **backends.backend_env("cpu:0")}))
    assert [d.device_id for d in devs] == ["cpu:0"]


def test_probe_all_devices_lists_lavapipe(vulkan_site, lavapipe_index):
    devs = backends.probe_all_devices({**vulkan_site, "GGML_VK_VISIBLE_DEVICES": None})
    ids = [d.device_id for d in devs]
    assert ids[0] == "cpu:0" and f"vulkan:{lavapipe_index}" in ids


# --------------------------------------------------------------------------- real decode on lavapipe

_DECODE_CHILD = r'''
import json, sys, time
cfg = json.loads(sys.argv[1])
t0 = time.perf_counter_ns()
import llama_cpp
t1 = time.perf_counter_ns()
llm = llama_cpp.Llama(model_path=cfg["model"], n_ctx=256, n_batch=256, n_threads=2, seed=0,
                      verbose=True, **cfg["params"])
t2 = time.perf_counter_ns()
toks = llm.tokenize(cfg["prompt"].encode(), add_bos=True)
arr = (llama_cpp.llama_token * len(toks))(*toks)
mem = llama_cpp.llama_get_memory(llm.ctx)
runs = []
for _ in range(cfg.get("reps", 2)):
    llama_cpp.llama_memory_clear(mem, True)
    batch = llama_cpp.llama_batch_get_one(arr, len(toks))
    a = time.perf_counter_ns()
    rc = llama_cpp.llama_decode(llm.ctx, batch)
    b = time.perf_counter_ns()
    llama_cpp.llama_synchronize(llm.ctx)
    c = time.perf_counter_ns()
    runs.append({"rc": rc, "decode_return_ns": b - a, "synchronize_ns": c - a})
n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(llm.model))
lp = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
logits = [lp[i] for i in range(n_vocab)]
print("RESULT:" + json.dumps({"import_ns": t1 - t0, "load_ns": t2 - t1, "n_tokens": len(toks), "runs": runs,
                             "argmax": max(range(n_vocab), key=logits.__getitem__), "logits": logits}))
'''

_PROMPT = "the cancel speech stop voice " * 8


def run_decode(env_overlay: dict, model: Path, params: dict, reps: int = 2) -> tuple[dict, str]:
    env = dict(os.environ)
    for k, v in env_overlay.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    cfg = {"model": str(model), "params": params, "prompt": _PROMPT, "reps": reps}
    cp = subprocess.run([sys.executable, "-c", _DECODE_CHILD, json.dumps(cfg)], env=env, capture_output=True,
                        text=True, timeout=900)
    line = next((ln for ln in cp.stdout.splitlines() if ln.startswith("RESULT:")), None)
    assert cp.returncode == 0 and line, f"decode child failed rc={cp.returncode}\n{cp.stderr[-4000:]}"
    return json.loads(line[len("RESULT:"):]), cp.stderr


def test_lavapipe_decode_returns_before_synchronize(vulkan_site, lavapipe_index, tiny_gguf):
    dev = f"vulkan:{lavapipe_index}"
    res, log = run_decode({**vulkan_site, **backends.backend_env(dev)}, tiny_gguf,
                          _params_for(dev))
    assert "llvmpipe" in log  # the Vulkan device was initialised ...
    assert "offloaded" in log and "layers to GPU" in log  # ... and the layers went to it
    offload_line = next(ln for ln in log.splitlines() if "layers to GPU" in ln)
    assert " 0/" not in offload_line, offload_line
    for run in res["runs"]:
        assert run["rc"] == 0
        # behaviour only: llama_decode may return before the device is done;
        # llama_synchronize is the completion point
        assert run["synchronize_ns"] >= run["decode_return_ns"] > 0


def test_vulkan_build_runs_cpu_trials_like_cpu_build(vulkan_site, tiny_gguf):
    """The Vulkan wheel with the CPU device's env/params computes what the CPU wheel computes."""
    cpu_site = _site_for("cpu")
    if cpu_site is None:
        pytest.skip(f"no CPU wheel in build/wheelhouse/{LLAMA_VERSION}-cpu to compare against")
    env, params = backends.backend_env("cpu:0"), _params_for("cpu:0")
    ref, _ = run_decode({**cpu_site, **env}, tiny_gguf, params, reps=1)
    got, log = run_decode({**vulkan_site, **env}, tiny_gguf, params, reps=1)
    assert "layers to GPU" not in log or "offloaded 0/" in log
    assert got["argmax"] == ref["argmax"]
    diff = max(abs(a - b) for a, b in zip(got["logits"], ref["logits"]))
    assert diff <= 1e-4 * max(1.0, max(abs(x) for x in ref["logits"]))
