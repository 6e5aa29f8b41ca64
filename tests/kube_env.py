"""A real Kubernetes control plane on loopback: etcd, kube-apiserver and kube-controller-manager.

Built by `.ci/kube-build` (binaries under /opt/cascadia-kube/bin or $CASCADIA_KUBE_BIN). Two users
come from a token file: an admin, and the operator's service account, so that the operator runs
with exactly the RBAC the chart gives it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

OPERATOR_NAMESPACE = "cascadia-system"
OPERATOR_ACCOUNT = "cascadia-operator"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_binaries() -> dict[str, str] | None:
    bin_dir = Path(os.environ.get("CASCADIA_KUBE_BIN", "/opt/cascadia-kube/bin"))
    found = {}
    for name in ("kube-apiserver", "kube-controller-manager", "helm"):
        path = bin_dir / name
        found[name] = str(path) if path.is_file() else shutil.which(name)
    found["etcd"] = shutil.which("etcd")
    found["kubectl"] = shutil.which("kubectl")
    return found if all(found.values()) else None


@dataclass
class KubeEnv:
    root: Path
    bins: dict[str, str]
    processes: list[subprocess.Popen] = field(default_factory=list)
    server: str = ""
    admin_config: Path = Path()
    operator_config: Path = Path()

    def start(self) -> None:
        root = self.root
        (root / "certs").mkdir(parents=True, exist_ok=True)
        subprocess.run(["openssl", "genrsa", "-out", str(root / "sa.key"), "2048"], check=True, capture_output=True)
        subprocess.run(
            ["openssl", "rsa", "-in", str(root / "sa.key"), "-pubout", "-out", str(root / "sa.pub")],
            check=True, capture_output=True,
        )  # fmt: skip
        admin_token, operator_token = "admin-" + os.urandom(8).hex(), "operator-" + os.urandom(8).hex()
        operator_user = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_ACCOUNT}"
        (root / "tokens.csv").write_text(
            f"{admin_token},admin,admin-uid,system:masters\n"
            f'{operator_token},{operator_user},operator-uid,"system:serviceaccounts,'
            f'system:serviceaccounts:{OPERATOR_NAMESPACE},system:authenticated"\n'
        )
        etcd_port, peer_port, api_port = _free_port(), _free_port(), _free_port()
        etcd_url = f"http://127.0.0.1:{etcd_port}"
        self._spawn("etcd", [
            self.bins["etcd"], "--data-dir", str(root / "etcd"), "--name", "test",
            "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
            "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-cluster", f"test=http://127.0.0.1:{peer_port}", "--unsafe-no-fsync=true",
        ])  # fmt: skip
        self._spawn("kube-apiserver", [
            self.bins["kube-apiserver"], f"--etcd-servers={etcd_url}", "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1", f"--secure-port={api_port}", "--insecure-port=0",
            f"--cert-dir={root / 'certs'}", f"--token-auth-file={root / 'tokens.csv'}",
            "--authorization-mode=RBAC", "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={root / 'sa.pub'}",
            f"--service-account-signing-key-file={root / 'sa.key'}",
            "--service-cluster-ip-range=10.0.0.0/24", "--allow-privileged=true",
            "--disable-admission-plugins=ServiceAccount",
        ])  # fmt: skip
        self.server = f"https://127.0.0.1:{api_port}"
        self.admin_config = self._kubeconfig("admin", admin_token)
        self.operator_config = self._kubeconfig("operator", operator_token)
        self._wait_ready(admin_token)
        self._spawn("kube-controller-manager", [
            self.bins["kube-controller-manager"], f"--kubeconfig={self.admin_config}",
            "--controllers=garbagecollector,statefulset,deployment,replicaset,namespace",
            "--leader-elect=false", "--bind-address=127.0.0.1", "--port=0", f"--secure-port={_free_port()}",
        ])  # fmt: skip

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = (self.root / f"{name}.log").open("w")
        self.processes.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))

    def _kubeconfig(self, user: str, token: str) -> Path:
        path = self.root / f"{user}.kubeconfig"
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": self.server, "insecure-skip-tls-verify": True}}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": user}}],
        }))  # fmt: skip
        return path

    def _wait_ready(self, token: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in self.processes:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited; see {self.root}")
            try:
                response = httpx.get(
                    self.server + "/readyz", headers={"Authorization": f"Bearer {token}"}, verify=False, timeout=2
                )
                if response.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"kube-apiserver not ready in {timeout} s; see {self.root}")

    def run(
        self, tool: str, *args: str, check: bool = True, stdin: str | None = None, config: Path | None = None
    ) -> subprocess.CompletedProcess:
        cmd = [self.bins[tool], *args, "--kubeconfig", str(config or self.admin_config)]
        result = subprocess.run(cmd, capture_output=True, text=True, input=stdin, timeout=120)
        if check and result.returncode != 0:
            raise AssertionError(f"{tool} {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
        return result

    def stop(self) -> None:
        for p in reversed(self.processes):
            if p.poll() is None:
                p.terminate()
        for p in self.processes:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
