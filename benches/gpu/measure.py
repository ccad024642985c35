#!/usr/bin/env python3
"""Compute and memory shares on a real GPU, from the daemon's own Allocate
responses.

For each backend (`mps`, `hami-core` when a libvgpu.so is given) this runs
`gpu-device-plugin` on NVML with that backend, admits containers through
`kubelet-allocate` (the kubelet stand-in's device manager), and starts each
workload process with exactly the envs and mounts the daemon answered. There
is no container runtime here, so a mount is applied the way the process sees
it: an env naming a mount's container path is rewritten to its host path,
and a mounted `/etc/ld.so.preload` becomes `LD_PRELOAD` of the library it
names. The baseline is the same workload with no grant.

Workloads (PyTorch): bf16 8192^3 matrix products (compute-bound, few large
blocks) and a 1 GiB fp32 elementwise add (memory-bound, many small blocks);
side-by-side runs start together after both are warm and count only the
window in which both run. Memory: a grant of 8 GiB allocates 6 GiB, and 10
GiB must be refused.

    measure.py --bin DIR [--hami-lib DIR] [--out DIR]

prints each case's figures and writes results-<cases>.json. MPS needs
`nvidia-cuda-mps-control` on the PATH (or in /usr/local/nvidia/bin).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MATMUL_N = 8192
ADD_BYTES = 1 << 30
GRANT_MIB = 8192
# Memory units of the daemon under test: gpu-memory devices of 1 GiB keep
# the Allocate requests short; the limits the daemon writes are in MiB.
UNIT_MIB = 1024


# ---------------------------------------------------------------- workloads


def workload(kind, seconds, ready, go):
    """One container's process: warm up, say ready, wait for go, run."""
    import torch

    dev = torch.device("cuda")
    if kind.startswith("memory:"):
        gib = float(kind.split(":")[1])
        try:
            x = torch.empty(int(gib * (1 << 30)), dtype=torch.uint8, device=dev)
            x.fill_(1)
            torch.cuda.synchronize()
            out = {"allocated": True}
        except Exception as e:  # the refusal is the point
            out = {"allocated": False, "error": str(e).splitlines()[0][:200]}
        print(json.dumps(out), flush=True)
        return
    if kind == "fault":
        # An illegal address: a fatal fault in this client's context.
        import cupy
        import numpy

        kernel = cupy.RawKernel(
            'extern "C" __global__ void f(int* p) { p[threadIdx.x] = 1; }', "f"
        )
        at = time.time()
        try:
            kernel((1,), (32,), (numpy.uint64(16),))
            cupy.cuda.Device().synchronize()
            out = {"faulted": False}
        except Exception as e:
            out = {"faulted": True, "at": at, "error": str(e)[:200]}
        print(json.dumps(out), flush=True)
        return
    if kind == "matmul":
        a = torch.randn(MATMUL_N, MATMUL_N, dtype=torch.bfloat16, device=dev)
        b = torch.randn(MATMUL_N, MATMUL_N, dtype=torch.bfloat16, device=dev)
        c = torch.empty_like(a)

        def step():
            torch.matmul(a, b, out=c)

        work = 2 * MATMUL_N**3  # FLOP per product
        per_sync = 1
    else:
        n = ADD_BYTES // 4
        a = torch.rand(n, device=dev)
        b = torch.rand(n, device=dev)
        c = torch.empty_like(a)

        def step():
            torch.add(a, b, out=c)

        work = 3 * ADD_BYTES  # bytes moved per add
        per_sync = 10
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    Path(ready).touch()
    while not Path(go).exists():
        time.sleep(0.005)
    t0 = time.time()
    stamps = []
    while time.time() < t0 + seconds:
        for _ in range(per_sync):
            step()
        torch.cuda.synchronize()
        stamps.append(time.time())
    print(json.dumps({"t0": t0, "stamps": stamps, "work": work * per_sync}), flush=True)


# ------------------------------------------------------------ orchestration


def apply_grant(grant):
    """The process environment a container with this grant would have."""
    env = dict(os.environ)
    mounts = grant["mounts"]
    for k, v in grant["envs"].items():
        for m in mounts:
            cp = m["container_path"]
            if v == cp or v.startswith(cp + "/"):
                v = m["host_path"] + v[len(cp) :]
                break
        env[k] = v
    for m in mounts:
        if m["container_path"] == "/etc/ld.so.preload":
            libs = Path(m["host_path"]).read_text().split()
            host = []
            for lib in libs:
                for n in mounts:
                    if lib == n["container_path"]:
                        lib = n["host_path"]
                host.append(lib)
            env["LD_PRELOAD"] = " ".join(host)
    return env


def run_together(kind, envs, seconds, tmp):
    """Runs one workload process per env, started together; the rate of
    each over the window in which all of them ran."""
    go = Path(tmp) / "go"
    go.unlink(missing_ok=True)
    procs = []
    for i, env in enumerate(envs):
        ready = Path(tmp) / f"ready{i}"
        ready.unlink(missing_ok=True)
        p = subprocess.Popen(
            [sys.executable, __file__, "workload", kind, str(seconds), str(ready), str(go)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        procs.append((p, ready))
    deadline = time.time() + 120
    while not all(r.exists() or p.poll() is not None for p, r in procs):
        if time.time() > deadline:
            break
        time.sleep(0.05)
    go.touch()
    results = []
    for p, _ in procs:
        out, err = p.communicate(timeout=seconds + 180)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if p.returncode != 0 or not lines:
            results.append({"error": (err.strip().splitlines() or ["no output"])[-1][:300]})
        else:
            results.append(json.loads(lines[-1]))
    if kind.startswith("memory:"):
        return results
    runs = [r for r in results if "stamps" in r]
    if len(runs) != len(results):
        return results
    lo = max(r["t0"] for r in runs) + 1.0
    hi = min(r["stamps"][-1] for r in runs) - 1.0
    rates = []
    for r in runs:
        n = sum(1 for s in r["stamps"] if lo < s <= hi)
        rates.append({"rate": n * r["work"] / (hi - lo), "window_s": round(hi - lo, 2)})
    return rates


class Daemon:
    """gpu-device-plugin on NVML with one enforcement backend."""

    def __init__(self, bindir, root, enforcement):
        self.bindir = Path(bindir)
        self.root = Path(root)
        self.plugins = self.root / "device-plugins"
        self.plugins.mkdir(parents=True, exist_ok=True)
        cfg = self.root / "config.toml"
        cfg.write_text(
            f'device_plugin_dir = "{self.plugins}"\n'
            "pod_matching = false\n"
            'node_name = "gpu-node"\n'
            'http_listen = "127.0.0.1:9446"\n'
            "watch_config = false\n"
            f"memory_unit_mib = {UNIT_MIB}\n"
            '[devices]\nbackend = "nvml"\n' + enforcement
        )
        self.log = open(self.root / "daemon.log", "w")
        self.proc = subprocess.Popen(
            [str(self.bindir / "gpu-device-plugin"), "--config", str(cfg), "run"],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        # Not /readyz: it is 503 until a kubelet has the plugins registered,
        # and the kubelet comes with each admission.
        time.sleep(1)
        if self.proc.poll() is not None:
            self.log.close()
            log = (self.root / "daemon.log").read_text()
            raise RuntimeError(f"daemon exited: {log[-2000:]}")

    def admit(self, *containers):
        out = subprocess.run(
            [str(self.bindir / "kubelet-allocate"), str(self.plugins), *containers],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if out.returncode != 0:
            raise RuntimeError(f"kubelet-allocate: {out.stderr.strip()}")
        return json.loads(out.stdout)

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


def mps_control():
    found = shutil.which("nvidia-cuda-mps-control")
    for d in ("/usr/local/nvidia/bin", "/usr/bin"):
        if not found and Path(d, "nvidia-cuda-mps-control").exists():
            found = str(Path(d, "nvidia-cuda-mps-control"))
    return found


def measure_backend(name, daemon, results, tmp, seconds):
    """The cases of the issue's table, for one backend."""
    out = results.setdefault(name, {})
    mem = f"gpu-memory={GRANT_MIB // UNIT_MIB}"
    alone = daemon.admit(f"gpu-core=30,{mem}")[0]
    out["grant_30"] = alone
    env = apply_grant(alone)
    out["matmul_30_alone"] = run_together("matmul", [env], seconds, tmp)[0]
    out["add_30_alone"] = run_together("add", [env], seconds, tmp)[0]
    out["memory_6GiB_of_8"] = run_together("memory:6", [env], 0, tmp)[0]
    out["memory_10GiB_of_8"] = run_together("memory:10", [env], 0, tmp)[0]
    limit = env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
    if limit and out["memory_10GiB_of_8"].get("allocated"):
        # The limit by UUID was not applied: does the form by index hold?
        by_index = {**env, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=" + limit.split("=")[-1]}
        out["memory_10GiB_of_8_by_index"] = run_together("memory:10", [by_index], 0, tmp)[0]
    pair = daemon.admit(f"gpu-core=30,{mem}", f"gpu-core=70,{mem}")
    envs = [apply_grant(g) for g in pair]
    out["matmul_30_70_pair"] = run_together("matmul", envs, seconds, tmp)
    out["add_30_70_pair"] = run_together("add", envs, seconds, tmp)
    print(f"{name}: {json.dumps({k: v for k, v in out.items() if 'grant' not in k})}", flush=True)


def fault_domain(daemon, control, pipes, results, tmp):
    """One MPS client of a GPU faults while another runs: what happens to
    the other, to the control daemon, and to the next client."""
    out = results.setdefault("mps-fault", {})
    mem = f"gpu-memory={GRANT_MIB // UNIT_MIB}"
    victim_env, faulter_env = (apply_grant(g) for g in daemon.admit(f"gpu-core=30,{mem}", f"gpu-core=70,{mem}"))
    ready, go = Path(tmp) / "victim-ready", Path(tmp) / "victim-go"
    go.touch()
    victim = subprocess.Popen(
        [sys.executable, __file__, "workload", "matmul", "20", str(ready), str(go)],
        env=victim_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 60
    while not ready.exists() and victim.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(2)
    fault = subprocess.run(
        [sys.executable, __file__, "workload", "fault", "0", "-", "-"],
        env=faulter_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line for line in fault.stdout.splitlines() if line.startswith("{")]
    out["faulter"] = json.loads(lines[-1]) if lines else {"error": fault.stderr[-300:]}
    vout, verr = victim.communicate(timeout=120)
    vlines = [line for line in vout.splitlines() if line.startswith("{")]
    victim_out = {"returncode": victim.returncode}
    if vlines:
        stamps = json.loads(vlines[-1])["stamps"]
        at = out["faulter"].get("at", 0)
        victim_out["products_before_fault"] = sum(1 for t in stamps if t < at)
        victim_out["products_after_fault"] = sum(1 for t in stamps if t > at + 0.5)
    else:
        victim_out["error"] = (verr.strip().splitlines() or ["none"])[-1][:300]
    out["victim"] = victim_out
    for gpu in pipes.iterdir():
        answer = subprocess.run(
            [control],
            input="get_server_list\n",
            capture_output=True,
            text=True,
            env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(gpu)},
            timeout=30,
        )
        out["control_after"] = {"rc": answer.returncode, "servers": answer.stdout.strip()}
    out["next_client_matmul_30"] = run_together("matmul", [victim_env], 4, tmp)[0]
    print(f"mps-fault: {json.dumps(out)}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True, help="gpu-device-plugin and kubelet-allocate")
    ap.add_argument("--hami-lib", help="directory holding a built libvgpu.so")
    ap.add_argument("--out", default=".")
    ap.add_argument("--seconds", type=float, default=12)
    ap.add_argument(
        "--cases",
        default="unlimited,mps,hami-core",
        help="comma-separated: unlimited, mps, mps-fault, hami-core (needs --hami-lib)",
    )
    args = ap.parse_args()
    cases = args.cases.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,uuid,memory.total", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    )
    results["device"] = smi.stdout.strip()
    print(f"device: {results['device']}", flush=True)
    tmp = tempfile.mkdtemp(prefix="gdp-measure-")

    def save():
        (out / f"results-{'-'.join(cases)}.json").write_text(json.dumps(results, indent=1))

    if "unlimited" in cases:
        base = results.setdefault("unlimited", {})
        env = dict(os.environ)
        base["matmul"] = run_together("matmul", [env], args.seconds, tmp)[0]
        base["add"] = run_together("add", [env], args.seconds, tmp)[0]
        base["matmul_pair"] = run_together("matmul", [env, env], args.seconds, tmp)
        print(f"unlimited: {json.dumps(base)}", flush=True)
        save()

    if "mps" in cases or "mps-fault" in cases:
        control = mps_control()
        pipes = Path(tmp) / "mps" / "pipe"
        try:
            daemon = Daemon(
                args.bin,
                Path(tmp) / "mps-node",
                '[enforcement]\nmode = "none"\ncompute = "mps"\n'
                f'[enforcement.mps]\ncontrol_binary = "{control}"\n'
                f'pipe_dir = "{pipes}"\nlog_dir = "{Path(tmp) / "mps" / "log"}"\n'
                'shm_dir = "/dev/shm"\n',
            )
            try:
                if "mps" in cases:
                    measure_backend("mps", daemon, results, tmp, args.seconds)
                if "mps-fault" in cases:
                    fault_domain(daemon, control, pipes, results, tmp)
            finally:
                daemon.stop()
                for gpu in pipes.iterdir() if pipes.exists() else []:
                    subprocess.run(
                        [control],
                        input="quit\n",
                        text=True,
                        env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(gpu)},
                        timeout=30,
                    )
        except Exception as e:
            results.setdefault("mps", {})["error"] = str(e)
            print(f"mps: {e}", flush=True)
        save()

    if args.hami_lib and "hami-core" in cases:
        try:
            daemon = Daemon(
                args.bin,
                Path(tmp) / "hami-node",
                '[enforcement]\nmode = "hami-core"\ncompute = "hami-core"\n'
                'core_policy = "force"\n'
                f'library_dir = "{Path(args.hami_lib).resolve()}"\n'
                f'state_dir = "{Path(tmp) / "hami-state"}"\n',
            )
            try:
                measure_backend("hami-core", daemon, results, tmp, args.seconds)
            finally:
                daemon.stop()
        except Exception as e:
            results.setdefault("hami-core", {})["error"] = str(e)
            print(f"hami-core: {e}", flush=True)
        save()
    for log in (Path(tmp) / "mps" / "log").glob("*/*.log"):
        shutil.copy(log, out / f"mps-{log.name}")
    for node in ("mps-node", "hami-node"):
        log = Path(tmp) / node / "daemon.log"
        if log.exists():
            shutil.copy(log, out / f"{node}.log")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "workload":
        workload(sys.argv[2], float(sys.argv[3]), sys.argv[4], sys.argv[5])
    else:
        main()
