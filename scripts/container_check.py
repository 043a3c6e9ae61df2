"""``make container-check``: build kvrelay's image with podman and serve a chat request from it, from the host.

One command, in this order (docs/operations/containers.md):

1. the base image ``kvrelay-base:bookworm`` from a debootstrap root (`scripts/container-base.sh`; kept once built);
2. the image ``kvrelay:cpu`` from ``Dockerfile`` (layers cached by podman), pip's configuration and the local package
   directories it names mounted into the build read-only, so the image installs from the sources this machine uses;
3. the reference: the same chat request (greedy) served by ``kvrelay up`` on this machine, outside any container;
4. all-in-one: one container, ``kvrelay up --host 0.0.0.0`` (router, prefill and decode inside), its router port
   published; the answer, read from the host with the official ``openai`` client, must equal the reference: the same
   text and the same token ids (``router.return_tokens_as_token_ids``: each logprob names its token id);
5. 1P1D: three containers (router, prefill, decode) on one podman network, each its own ``kvrelay <role>``, finding
   each other by container name (`deploy/configs/container-1p1d.yaml`), the KV crossing containers through NIXL
   (UCX over TCP); again answered from the host and compared exactly.

Everything it started is removed at the end, also on failure or Ctrl-C. Prints one JSON summary (image size, build
times, time from ``podman run`` to the first answer, the match of each layout) and writes it to ``--out``; exits 1
when a layout's answer differs or fails. Root only (rootful podman: debootstrap needs root anyway).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a file (`python scripts/container_check.py`): the checkout's kvrelay

from kvrelay.benchmarks.deployment import Deployment, merge  # noqa: E402
from kvrelay.deploy.config import DEFAULT_CONFIG  # noqa: E402
from kvrelay.deploy.ports import free_ports  # noqa: E402

BASE_IMAGE = "kvrelay-base:bookworm"
IMAGE = "kvrelay:cpu"
NETWORK = "kvrelay-check"
PREFIX = "kvrelay-check-"  # every container this check starts; removed by name at the start and the end
ONE_CONFIG = REPO / "deploy" / "configs" / "local.yaml"
SPLIT_CONFIG = REPO / "deploy" / "configs" / "container-1p1d.yaml"
# What the check adds to both configs: token ids in each logprob (the exact comparison), and KV sized in bytes, small:
# fraction_of_free sizes from free memory (the tiers are zeroed, so touched), and this machine is shared.
CHECK_OVERRIDES: dict[str, Any] = {
    "router": {"return_tokens_as_token_ids": True},
    "kvstore": {"device": {"bytes": "256MiB"}, "host": {"bytes": "256MiB", "fraction_of_free": None},
                "disk": {"bytes": "1GiB"}},
}
# README's request: an answer longer than MAX_TOKENS, so every compared answer is MAX_TOKENS tokens long.
MESSAGES = [{"role": "user", "content": "Give me one tip for writing clear code."}]
MAX_TOKENS = 48
START_TIMEOUT_S = 300.0
# Podman here (Debian 12's 4.3, a VM whose root has no CAP_SYS_RESOURCE, cgroup v1 with a controller also in v2):
# * crun refuses the hybrid cgroup layout ("cgroups in hybrid mode not supported, drop all controllers from
#   cgroupv2"); runc (Debian's package) runs it.
# * podman's default rlimits (nofile 1048576) exceed the hard limits this machine grants, and without
#   CAP_SYS_RESOURCE the runtime cannot raise them ("setrlimit `RLIMIT_NOFILE`: Operation not permitted"): nofile is
#   held to this process's hard limit, nproc to 32768 (the most the runtime could set here).
PODMAN = ["podman", "--runtime", "runc"]


def rlimit_flags() -> list[str]:
    """``--ulimit`` flags no higher than this process's hard limits (see `PODMAN`)."""
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], 32768)
    return ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}"]


def podman(*args: str, check: bool = True, capture: bool = True, timeout_s: float = 600.0) -> str:
    """Run ``podman ARGS`` (with `PODMAN`'s runtime); its stdout. Raises CalledProcessError (with its stderr)."""
    proc = subprocess.run([*PODMAN, *args], capture_output=capture, text=True, timeout=timeout_s)
    if check and proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, proc.args, proc.stdout, proc.stderr)
    return proc.stdout or ""


def build_mounts() -> list[str]:
    """``-v`` flags for ``podman build``: pip's configuration and what it names (find-links, file:// indexes,
    constraints, the CA bundle a TLS-inspecting proxy needs), each where it exists, read-only at the same path."""
    home = Path.home()
    paths = [Path("/etc/pip.conf"), Path("/etc/xdg/pip"), home / ".config/pip", home / ".pip",
             Path("/opt/wheels"), Path("/opt/pypi"), Path("/opt/pypi-more"), Path("/etc/ssl/certs/ca-certificates.crt")]
    flags: list[str] = []
    for p in paths:
        if p.exists():
            # The user's config lands where the build's root user reads it.
            target = Path("/root") / p.relative_to(home) if p.is_relative_to(home) else p
            flags += ["-v", f"{p}:{target}:ro"]
    return flags


def torch_index() -> str:
    """The ``TORCH_INDEX`` build argument: empty where pip's find-links already hold torch's CPU build (this
    machine: /opt/wheels; download.pytorch.org is out of reach), else the Dockerfile's default index."""
    local = list(Path("/opt/wheels").glob("torch-*+cpu-*.whl")) if Path("/opt/wheels").is_dir() else []
    return "" if local else "https://download.pytorch.org/whl/cpu"


def build_images() -> dict[str, Any]:
    """The base (kept when present) and the image; seconds each took, and the image's size."""
    t0 = time.monotonic()
    subprocess.run(["bash", str(REPO / "scripts" / "container-base.sh")], check=True,
                   env={**os.environ, "PODMAN": " ".join(PODMAN)})
    t1 = time.monotonic()
    subprocess.run([*PODMAN, "build", *rlimit_flags(), *build_mounts(), "--build-arg", f"BASE={BASE_IMAGE}",
                    "--build-arg", f"TORCH_INDEX={torch_index()}", "-t", IMAGE, str(REPO)], check=True)
    t2 = time.monotonic()
    size = int(podman("image", "inspect", "--format", "{{.Size}}", IMAGE).strip())
    return {"base_s": round(t1 - t0, 1), "image_build_s": round(t2 - t1, 1), "image_bytes": size,
            "base_bytes": int(podman("image", "inspect", "--format", "{{.Size}}", BASE_IMAGE).strip())}


def readable_model(model_dir: Path, work: Path) -> Path:
    """``model_dir``, or a copy in ``work`` when some file in it is not readable by others: the image runs as uid
    10001, and `kvrelay model pull` leaves the weights 0600 (owner only)."""
    files = [p for p in model_dir.iterdir() if p.is_file()]
    if all(p.stat().st_mode & stat.S_IROTH for p in files):
        return model_dir
    copy = work / model_dir.name
    shutil.copytree(model_dir, copy)
    for p in [copy, *copy.iterdir()]:
        p.chmod(p.stat().st_mode | stat.S_IROTH | (stat.S_IXOTH if p.is_dir() else 0))
    print(f"container-check: {model_dir} has files only their owner reads; mounting a readable copy", flush=True)
    return copy


@dataclass(frozen=True, slots=True)
class Answer:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str


def chat(url: str, model: str) -> Answer:
    """The check's chat request, greedy, through the official client; the text and the token ids (each logprob's
    ``token_id:N``, under ``router.return_tokens_as_token_ids``).

    Raises:
        openai.APIError: the server failed the request; ValueError: a logprob that names no token id.
    """
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                         logprobs=True)
    choice = out.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    ids = []
    for lp in choice.logprobs.content:
        if not lp.token.startswith("token_id:"):
            raise ValueError(f"logprob token {lp.token!r} names no id; is router.return_tokens_as_token_ids set?")
        ids.append(int(lp.token.removeprefix("token_id:")))
    return Answer(choice.message.content or "", tuple(ids), choice.finish_reason)


def first_answer(url: str, model: str, *, since: float, running: list[str]) -> tuple[Answer, float]:
    """The first answer ``url`` gives (retrying while it starts) and the seconds from ``since`` to it.

    Raises:
        RuntimeError: a container of ``running`` exited, or no answer within `START_TIMEOUT_S`.
    """
    import openai

    last: Exception | None = None
    while time.monotonic() - since < START_TIMEOUT_S:
        check_running(running)
        try:
            answer = chat(url, model)
            return answer, time.monotonic() - since
        except (openai.APIConnectionError, openai.APIStatusError) as exc:  # not up yet (connect error, 503)
            last = exc
            time.sleep(1.0)
    raise RuntimeError(f"no answer at {url} within {START_TIMEOUT_S:.0f} s; last error: {last!r}")


def check_running(names: list[str]) -> None:
    """Raises RuntimeError naming the first container of ``names`` that is not running (exited, gone)."""
    for name in names:
        state = podman("inspect", "--format", "{{.State.Status}}", name, check=False).strip()
        if state != "running":
            raise RuntimeError(f"container {name} is {state or 'gone'}")


def wait_ready(name: str, port: int, *, since: float, running: list[str]) -> None:
    """Until the node in container ``name`` answers ``/ready`` (asked from inside it: node ports are not published).

    Raises:
        RuntimeError: a container of ``running`` exited, or not ready within `START_TIMEOUT_S` of ``since``.
    """
    probe = f"import urllib.request as u; u.urlopen('http://127.0.0.1:{port}/ready', timeout=2)"
    while time.monotonic() - since < START_TIMEOUT_S:
        check_running(running)
        if subprocess.run([*PODMAN, "exec", name, "python", "-c", probe], capture_output=True).returncode == 0:
            return
        time.sleep(1.0)
    raise RuntimeError(f"{name} not ready within {START_TIMEOUT_S:.0f} s")


def write_config(base: Path, overrides: dict[str, Any], path: Path) -> Path:
    path.write_text(yaml.safe_dump(merge(yaml.safe_load(base.read_text()), overrides), sort_keys=False))
    return path


def run_container(name: str, *args: str, volumes: list[str], publish: str | None = None,
                  env: dict[str, str] | None = None, network: str | None = None) -> None:
    """``podman run -d`` of the image as container ``name`` (host name ``name``: what a node advertises as its
    address when bound to 0.0.0.0), ``args`` to ``kvrelay``."""
    flags = ["--name", name, "--hostname", name, *rlimit_flags()]
    flags += ["--network", network] if network else []
    flags += [f for v in volumes for f in ("-v", v)]
    flags += ["-p", publish] if publish else []
    flags += [f for k, v in (env or {}).items() for f in ("-e", f"{k}={v}")]
    podman("run", "-d", *flags, IMAGE, *args)


def remove_all() -> None:
    """Remove every container of this check (running or not) and its network; quiet when there are none."""
    names = podman("ps", "-a", "--filter", f"name=^{PREFIX}", "--format", "{{.Names}}", check=False).split()
    if names:
        podman("rm", "-f", "-t", "10", *names, check=False)
    podman("network", "rm", "-f", NETWORK, check=False)


def show_logs(names: list[str]) -> None:
    for name in names:
        logs = subprocess.run([*PODMAN, "logs", "--tail", "40", name], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True).stdout
        print(f"---- podman logs {name} (last 40 lines) ----\n{logs}", file=sys.stderr)


@contextmanager
def containers(names: list[str]) -> Iterator[None]:
    """Logs of ``names`` on failure; every container of the check removed however this ends."""
    try:
        yield
    except BaseException:
        show_logs(names)
        raise
    finally:
        remove_all()


def compare(got: Answer, want: Answer) -> dict[str, Any]:
    return {"exact": got == want, "text": got.text, "token_ids": len(got.token_ids),
            **({} if got == want else {"want_text": want.text, "want_token_ids": list(want.token_ids),
                                        "got_token_ids": list(got.token_ids)})}


def check_one(model: Path, model_name: str, work: Path, want: Answer) -> dict[str, Any]:
    """All-in-one: ``kvrelay up --host 0.0.0.0`` in one container, its router port published on a free host port."""
    config = write_config(ONE_CONFIG, merge(CHECK_OVERRIDES, {"model": {"path": f"/models/{model.name}"}}),
                          work / "one.yaml")
    [port] = free_ports(1)
    name = PREFIX + "one"
    with containers([name]):
        t0 = time.monotonic()
        run_container(name, "up", "--host", "0.0.0.0", "--config", "/etc/kvrelay/kvrelay.yaml",
                      volumes=[f"{model}:/models/{model.name}:ro", f"{config}:/etc/kvrelay/kvrelay.yaml:ro"],
                      publish=f"127.0.0.1:{port}:8000")
        got, first_s = first_answer(f"http://127.0.0.1:{port}", model_name, since=t0, running=[name])
    return {"first_answer_s": round(first_s, 1), "host_port": port, **compare(got, want)}


def check_split(model: Path, model_name: str, work: Path, want: Answer) -> dict[str, Any]:
    """1P1D: router, prefill and decode containers on network `NETWORK`, one internal token, the router's port
    published. The decode node pulls the prefill node's KV over NIXL (UCX held to TCP: the containers share no
    memory, so UCX's shared-memory transports must not be picked)."""
    # The config's node URLs name the containers kvrelay-prefill and kvrelay-decode; this check's have its prefix.
    urls = {"prefill_urls": [f"http://{PREFIX}prefill:8100"], "decode_urls": [f"http://{PREFIX}decode:8200"]}
    config = write_config(SPLIT_CONFIG, merge(CHECK_OVERRIDES, {"model": {"path": f"/models/{model.name}"},
                                                                "router": urls}), work / "split.yaml")
    [port] = free_ports(1)
    volumes = [f"{model}:/models/{model.name}:ro", f"{config}:/etc/kvrelay/kvrelay.yaml:ro"]
    env = {"KVRELAY_INTERNAL_TOKEN": secrets.token_urlsafe(32), "UCX_TLS": "tcp"}
    names = [PREFIX + role for role in ("prefill", "decode", "router")]
    with containers(names):
        t0 = time.monotonic()
        podman("network", "create", NETWORK)
        for name in names:
            role = name.removeprefix(PREFIX)
            if role == "router":
                # The router gives up when no node answers within 120 s of its start; the nodes load the model and
                # measure their kernel plan first (tens of seconds, minutes on a loaded machine), so it starts last.
                for node, node_port in ((PREFIX + "prefill", 8100), (PREFIX + "decode", 8200)):
                    wait_ready(node, node_port, since=t0, running=names[:2])
            run_container(name, role, "--config", "/etc/kvrelay/kvrelay.yaml", "--name", role, volumes=volumes,
                          env=env, network=NETWORK, publish=f"127.0.0.1:{port}:8000" if role == "router" else None)
        got, first_s = first_answer(f"http://127.0.0.1:{port}", model_name, since=t0, running=names)
        plans = json.loads(podman("exec", PREFIX + "router", "python", "-c", ROUTER_PLANS))
    return {"first_answer_s": round(first_s, 1), "host_port": port, "router_plans": plans, **compare(got, want)}


# Where the router placed the prompts, {plan: requests} from kvrelay_router_plans_total{plan="..."} (run in the router
# container): "disaggregated" is a prompt prefilled in the prefill container and its KV pulled by the decode one.
ROUTER_PLANS = ("import json, re, urllib.request as u; t = u.urlopen('http://127.0.0.1:8000/metrics').read().decode(); "
                "print(json.dumps({m[0]: float(m[1]) for m in "
                "re.findall(r'^kvrelay_router_plans_total\\{plan=\"(\\w+)\"\\} (\\S+)$', t, re.M)}))")


def reference(model: Path) -> tuple[Answer, str]:
    """The answer of ``kvrelay up`` on this machine (the local config with `CHECK_OVERRIDES`), and the model name."""
    with Deployment(model, base_config=DEFAULT_CONFIG, overrides=CHECK_OVERRIDES) as d:
        return chat(d.url, d.model_name), d.model_name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=REPO / ".models" / "smollm2-135m-instruct",
                        help="a model directory (default: what `make model` pulls)")
    parser.add_argument("--out", type=Path, default=REPO / "bench-out" / "container-check.json")
    parser.add_argument("--skip-build", action="store_true", help="use the images already built")
    args = parser.parse_args(argv)
    # SIGTERM (a timeout, a CI runner) ends this like Ctrl-C: the `finally`s remove the containers and stop the
    # reference deployment (Python's default for SIGTERM exits at once, running none of them).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if shutil.which("podman") is None:
        print("container-check: podman is not installed (Debian: apt-get install podman buildah debootstrap runc)",
              file=sys.stderr)
        return 2
    model = args.model.resolve()
    if not (model / "config.json").is_file():
        print(f"container-check: {model} is not a model directory; `make model` pulls it", file=sys.stderr)
        return 2
    remove_all()  # what an earlier, killed run left
    summary: dict[str, Any] = {"machine": machine()}
    if not args.skip_build:
        summary["build"] = build_images()
    summary["image_bytes"] = int(podman("image", "inspect", "--format", "{{.Size}}", IMAGE).strip())
    with tempfile.TemporaryDirectory(prefix="kvrelay-container-check-") as tmp:
        work = Path(tmp)
        work.chmod(0o755)  # the configs written here are mounted into containers that run as uid 10001
        mounted = readable_model(model, work)
        want, model_name = reference(model)
        summary["reference"] = {"text": want.text, "token_ids": list(want.token_ids),
                                "finish_reason": want.finish_reason}
        summary["all_in_one"] = check_one(mounted, model_name, work, want)
        summary["1p1d"] = check_split(mounted, model_name, work, want)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    split = summary["1p1d"]
    crossed = split["router_plans"].get("disaggregated", 0) >= 1 and not split["router_plans"].get("local")
    ok = summary["all_in_one"]["exact"] and split["exact"] and crossed
    print(f"container-check: {'PASS' if ok else 'FAIL'}: all-in-one exact={summary['all_in_one']['exact']}, "
          f"1P1D exact={split['exact']}, 1P1D prefilled in the prefill container={crossed} (written to {args.out})")
    return 0 if ok else 1


def machine() -> dict[str, Any]:
    """What the numbers were measured on: CPU model and count, memory, podman's version."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown")
    mem_kib = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal"))
    return {"cpu": cpu, "cpus": os.cpu_count(), "memory_gib": round(mem_kib / 2**20, 1),
            "podman": podman("version", "--format", "{{.Client.Version}}").strip()}


if __name__ == "__main__":
    raise SystemExit(main())
