#!/usr/bin/env python3
"""DRA-prepared shares on a real GPU: the same measurements as measure.py,
with each container started from the CDI spec the daemon wrote for its
claim.

One node of the real components (tests/kube's `kube-peers`): the control
plane, the kube-scheduler on its default profile (its DynamicResources
plugin allocates), and the kubelet peer (the kubelet's DRA manager prepares
the claims through the daemon), beside `gpu-device-plugin` on NVML in DRA
mode, with the DRA objects applied as shipped (deploy/ with the Component
deploy/dra). For each backend the daemon is (re)started with that
`[enforcement]`; pods asking a ResourceClaimTemplate of `memory: 8Gi,
cores: N` are created; once the kubelet records their CDI devices, each
container's process starts with the envs and mounts of that CDI spec.

    dra.py --bin DIR --peers KUBE_PEERS [--hami-lib DIR] [--out DIR] [--dry]

`--dry` runs everything but the GPU workloads (mock GPUs, no NVML): the
check that the cluster, the claims and the CDI specs work, on any machine.
"""

import argparse
import base64
import json
import os
import subprocess
import sys
import tempfile
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path

import measure
import yaml

REPO = Path(__file__).resolve().parents[2]
NS = "dra-gpu"
NODE = "gpu-node"
DRIVER = "gpu.doslab.io"


class Cluster:
    """The control plane, the scheduler and one node's kubelet peer."""

    def __init__(self, peers, root):
        self.peers = str(peers)
        self.root = Path(root)
        self.state = self.root / "state"
        self.procs = []
        self.spawn("controlplane", ["controlplane", "--dir", str(self.state)])
        self.wait(lambda: (self.state / "ready").exists(), 180, "control plane")
        self.admin = str(self.state / "admin.kubeconfig")
        for tree in ["deploy", "deploy/scheduler", str(self.overlay())]:
            self.ok(["apply", "--kubeconfig", self.admin, "-k", str(REPO / tree)])
        sched = self.root / "scheduler.kubeconfig"
        self.ok(["token", "--kubeconfig", self.admin, "--namespace", "kube-system",
                 "--name", "doslab-gpu-scheduler", "--out", str(sched)])
        profile = self.root / "scheduler.yaml"
        profile.write_text(
            "apiVersion: kubescheduler.config.k8s.io/v1\nkind: KubeSchedulerConfiguration\n"
            f"leaderElection:\n  leaderElect: false\nclientConnection:\n  kubeconfig: {sched}\n"
        )
        self.spawn("scheduler", ["kube-scheduler", "--config", str(profile), "--secure-port=0"])
        self.node = self.root / "node"
        for sub in ["device-plugins", "kubelet/plugins_registry", "kubelet/plugins", "cdi"]:
            (self.node / sub).mkdir(parents=True, exist_ok=True)
        kubelet_kc = str(self.node / "kubelet.kubeconfig")
        self.ok(["node-kubeconfig", "--dir", str(self.state), "--node", NODE, "--out", kubelet_kc])
        self.spawn("kubelet", ["kubelet", "--kubeconfig", kubelet_kc, "--node", NODE,
                               "--root", str(self.node / "kubelet"),
                               "--device-plugins", str(self.node / "device-plugins")])
        pod = f"gpu-device-plugin-{NODE}"
        self.apply(
            f"apiVersion: v1\nkind: Pod\nmetadata: {{name: {pod}, namespace: gpu-device-plugin}}\n"
            f"spec:\n  nodeName: {NODE}\n  serviceAccountName: gpu-device-plugin\n"
            "  containers: [{name: plugin, image: gpu-device-plugin}]\n"
            f"---\napiVersion: v1\nkind: Namespace\nmetadata: {{name: {NS}}}\n"
            "---\napiVersion: resource.k8s.io/v1\nkind: ResourceClaimTemplate\n"
            f"metadata: {{name: share, namespace: {NS}}}\n"
            "spec:\n  spec:\n    devices:\n      requests:\n      - name: gpu\n"
            f"        exactly: {{deviceClassName: {DRIVER}, capacity: {{requests: "
            "{memory: 8Gi, cores: \"30\"}}}\n"
            "---\napiVersion: resource.k8s.io/v1\nkind: ResourceClaimTemplate\n"
            f"metadata: {{name: share70, namespace: {NS}}}\n"
            "spec:\n  spec:\n    devices:\n      requests:\n      - name: gpu\n"
            f"        exactly: {{deviceClassName: {DRIVER}, capacity: {{requests: "
            "{memory: 8Gi, cores: \"70\"}}}\n"
        )
        self.daemon_kc = str(self.node / "daemon.kubeconfig")
        self.ok(["token", "--kubeconfig", self.admin, "--namespace", "gpu-device-plugin",
                 "--name", "gpu-device-plugin", "--pod", pod, "--out", self.daemon_kc])

    def overlay(self):
        """DRA mode as an operator deploys it: deploy/ and deploy/dra."""
        d = REPO / ".gpubin" / "dra-overlay"
        d.mkdir(parents=True, exist_ok=True)
        (d / "kustomization.yaml").write_text(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
            "resources: [../../deploy]\ncomponents: [../../deploy/dra]\n"
        )
        return d.relative_to(REPO)

    def spawn(self, name, args):
        log = open(self.root / f"{name}.log", "w")
        self.procs.append((name, subprocess.Popen([self.peers, *args], stdout=log,
                                                  stderr=subprocess.STDOUT)))

    def ok(self, args):
        out = subprocess.run([self.peers, *args], capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"kube-peers {args[0]}: {out.stderr[-2000:]}")

    def apply(self, yaml):
        f = self.root / f"apply-{time.time_ns()}.yaml"
        f.write_text(yaml)
        self.ok(["apply", "--kubeconfig", self.admin, "-f", str(f)])

    def api(self, method, path):
        """One call to the API server as the admin; the HTTP status."""
        kc = yaml.safe_load(Path(self.admin).read_text())
        cluster, user = kc["clusters"][0]["cluster"], kc["users"][0]["user"]
        ca = base64.b64decode(cluster["certificate-authority-data"]).decode()
        req = urllib.request.Request(cluster["server"] + path, method=method,
                                     headers={"Authorization": f"Bearer {user['token']}"})
        try:
            with urllib.request.urlopen(req, context=ssl.create_default_context(cadata=ca),
                                        timeout=10) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    def delete_pods(self, names):
        """Deletes the pods and waits until they are gone: the kubelet has
        unprepared their claims and the room is free again."""
        for n in names:
            self.api("DELETE", f"/api/v1/namespaces/{NS}/pods/{n}")
        for n in names:
            self.wait(lambda: self.api("GET", f"/api/v1/namespaces/{NS}/pods/{n}") == 404,
                      60, f"pod {n} gone")

    def wait(self, done, within, what):
        deadline = time.time() + within
        while not done():
            if time.time() > deadline:
                raise RuntimeError(f"{what} not ready within {within} s\n{self.logs()}")
            time.sleep(0.2)

    def record(self, name):
        path = self.node / "kubelet" / "pods" / f"{NS}_{name}.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    def grant(self, name):
        """The container's envs and mounts from its claim's CDI spec."""
        def cdi_ids():
            return ((self.record(name) or {}).get("cdiDevices") or {}).get("main")

        self.wait(cdi_ids, 120, f"pod {name}")
        ids = cdi_ids()
        envs, mounts = {}, []
        for spec_file in (self.node / "cdi").iterdir():
            spec = json.loads(spec_file.read_text())
            for device in spec.get("devices", []):
                if f"{spec['kind']}={device['name']}" not in ids:
                    continue
                for edits in (spec.get("containerEdits", {}), device.get("containerEdits", {})):
                    for kv in edits.get("env", []):
                        k, v = kv.split("=", 1)
                        envs[k] = v
                    for m in edits.get("mounts", []):
                        mounts.append({"container_path": m["containerPath"],
                                       "host_path": m["hostPath"], "read_only": False})
        return {"cdi": ids, "envs": envs, "mounts": mounts}

    def claim_pods(self, names, template):
        docs = []
        for n in names:
            docs.append(
                f"apiVersion: v1\nkind: Pod\nmetadata: {{name: {n}, namespace: {NS}}}\nspec:\n"
                f"  resourceClaims: [{{name: gpu, resourceClaimTemplateName: {template}}}]\n"
                "  containers: [{name: main, image: app, resources: {claims: [{name: gpu}]}}]\n"
            )
        self.apply("---\n".join(docs))

    def logs(self):
        out = ""
        for name, _ in self.procs:
            text = (self.root / f"{name}.log").read_text(errors="replace")
            out += f"--- {name}\n{text[-3000:]}\n"
        daemon = self.node / "daemon.log"
        if daemon.exists():
            out += f"--- daemon\n{daemon.read_text(errors='replace')[-3000:]}\n"
        return out

    def stop(self):
        for _, p in reversed(self.procs):
            p.terminate()
        for _, p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


class DraDaemon:
    """gpu-device-plugin in DRA mode on the cluster's node."""

    def __init__(self, bindir, cluster, enforcement, dry):
        node = cluster.node
        devices = ('[devices]\nbackend = "mock"\n[[devices.mock]]\n'
                   'uuid = "GPU-00000000-0000-4000-8000-000000000000"\nmemory_mib = 81920\n'
                   if dry else '[devices]\nbackend = "nvml"\n')
        cfg = node / "daemon.toml"
        cfg.write_text(
            f'device_plugin_dir = "{node / "device-plugins"}"\nresources = []\n'
            f'pod_matching = false\nnode_name = "{NODE}"\nhttp_listen = ""\n'
            f'watch_config = false\n[matcher]\nkubeconfig = "{cluster.daemon_kc}"\n'
            f"{devices}{enforcement}"
            f'[dra]\nenabled = true\nplugins_registry_dir = "{node / "kubelet/plugins_registry"}"\n'
            f'plugins_dir = "{node / "kubelet/plugins"}"\ncdi_dir = "{node / "cdi"}"\n'
            f'state_dir = "{node / "dra"}"\n'
        )
        self.log = open(node / "daemon.log", "a")
        self.proc = subprocess.Popen([str(Path(bindir) / "gpu-device-plugin"), "--config",
                                      str(cfg), "run"], stdout=self.log, stderr=subprocess.STDOUT)

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


def phase(name, cluster, daemon_args, pods, results, tmp, seconds, dry):
    """One backend: a lone 8 GiB / 30 % share (matrix products, the add,
    memory within and beyond the grant) and, under MPS, 30 % beside 70 %."""
    daemon = DraDaemon(*daemon_args)
    out = results.setdefault(name, {})
    try:
        cluster.claim_pods([pods[0]], "share")
        alone = cluster.grant(pods[0])
        out["grant_30"] = alone
        print(f"{name}: {pods[0]} got {alone['cdi']}: "
              f"{ {k: v for k, v in alone['envs'].items() if k.startswith('CUDA')} }", flush=True)
        if not dry:
            env = measure.apply_grant(alone)
            out["matmul_30_alone"] = measure.run_together("matmul", [env], seconds, tmp)[0]
            out["add_30_alone"] = measure.run_together("add", [env], seconds, tmp)[0]
            out["memory_6GiB_of_8"] = measure.run_together("memory:6", [env], 0, tmp)[0]
            out["memory_10GiB_of_8"] = measure.run_together("memory:10", [env], 0, tmp)[0]
        # The lone share leaves before the pair: 30 + 30 + 70 cores would
        # not fit one GPU.
        cluster.delete_pods([pods[0]])
        if len(pods) == 3:
            cluster.claim_pods([pods[1]], "share")
            cluster.claim_pods([pods[2]], "share70")
            pair = [cluster.grant(pods[1]), cluster.grant(pods[2])]
            out["grant_pair"] = pair
            if not dry:
                envs = [measure.apply_grant(g) for g in pair]
                out["matmul_30_70_pair"] = measure.run_together("matmul", envs, seconds, tmp)
        print(f"{name}: {json.dumps({k: v for k, v in out.items() if 'grant' not in k})}",
              flush=True)
        cluster.delete_pods(pods[1:])
    finally:
        daemon.stop()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True, help="holds gpu-device-plugin")
    ap.add_argument("--peers", required=True, help="the kube-peers binary")
    ap.add_argument("--hami-lib", help="directory holding a built libvgpu.so")
    ap.add_argument("--out", default=".")
    ap.add_argument("--seconds", type=float, default=8)
    ap.add_argument("--dry", action="store_true", help="no GPU: mock devices, no workloads")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="gdp-dra-")
    results = {}
    cluster = Cluster(args.peers, tmp)
    try:
        if args.hami_lib:
            lib = Path(args.hami_lib).resolve()
            enforcement = (f'[enforcement]\nmode = "hami-core"\nlibrary_dir = "{lib}"\n'
                           f'state_dir = "{Path(tmp) / "hami-state"}"\n')
            phase("dra-hami-core", cluster, (args.bin, cluster, enforcement, args.dry),
                  ["hami-1"], results, tmp, args.seconds, args.dry)
        control = measure.mps_control() or "/usr/bin/nvidia-cuda-mps-control"
        pipes = Path(tmp) / "mps" / "pipe"
        enforcement = ('[enforcement]\nmode = "none"\ncompute = "mps"\n'
                       f'[enforcement.mps]\ncontrol_binary = "{control}"\npipe_dir = "{pipes}"\n'
                       f'log_dir = "{Path(tmp) / "mps" / "log"}"\nshm_dir = "/dev/shm"\n')
        phase("dra-mps", cluster, (args.bin, cluster, enforcement, args.dry),
              ["mps-1", "mps-2", "mps-3"], results, tmp, args.seconds, args.dry)
        for gpu in pipes.iterdir() if pipes.exists() else []:
            subprocess.run([control], input="quit\n", text=True, timeout=30,
                           env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(gpu)})
    except Exception as e:
        results["error"] = str(e)[:4000]
        print(f"error: {e}", file=sys.stderr, flush=True)
        (out / "cluster.log").write_text(cluster.logs())
    finally:
        cluster.stop()
        (out / "results-dra.json").write_text(json.dumps(results, indent=1))
    return 1 if "error" in results else 0


if __name__ == "__main__":
    sys.exit(main())
