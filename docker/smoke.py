"""Runs the built image's filesystem far enough to serve one completion, as `docker run` would (`make image-test`).

`podman run` is refused by this sandbox's rlimits, so the image is started by hand, from its own config
(`podman image inspect`: Entrypoint, Cmd, Env, User, WorkingDir, Healthcheck) and its filesystem (`podman image
mount`), in a private mount namespace (`unshare -m`) that makes it look like `docker run --read-only`: the image
root bind-mounted read-only, tmpfs on /tmp and /run, the cache and state dirs tmpfs owned by the image's user (volumes),
/proc and /dev from the host, then `chroot --userspec` to that user. The network is the host's, so the server is
reached from here on loopback. Checks, in order:
1. the image's default environment (0.0.0.0, no key) refuses to start, in one line;
2. the serving user cannot write the model files, and the venv has no torch/transformers and no editable install;
3. with a key file (APPLIANCE_API_KEY_FILE, as an operator's mount) the image's HEALTHCHECK command turns healthy,
   one chat completion is served to the real `openai` client, a request without the key is refused (401);
4. SIGTERM to PID 1 (tini) stops it cleanly. Each step prints its time.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

START = time.monotonic()
KEY = "image-test-key"


def log(message: str) -> None:
    print(f"[smoke {time.monotonic() - START:6.1f}s] {message}", flush=True)


def podman(store: str, *args: str) -> str:
    flags = ["--root", f"{store}/storage", "--runroot", f"{store}/run", "--storage-driver", "vfs"]
    return subprocess.run(["podman", *flags, *args], check=True, capture_output=True, text=True).stdout.strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_script(root: str, uid: str, cache_dir: str, state_dir: str) -> str:
    """The mounts of a `docker run --read-only --tmpfs /tmp --tmpfs /run -v cache:<cache_dir> -v state:<state_dir>`."""
    r = shlex.quote(root)
    return "; ".join(
        [
            "set -e",
            f"mount --bind {r} {r}",
            f"mount -o remount,bind,ro {r}",
            f"mount -t proc proc {r}/proc",
            f"mount --rbind /dev {r}/dev",
            f"mount --rbind /sys {r}/sys && mount -o remount,bind,ro {r}/sys",  # OpenVINO reads the CPU topology
            f"mount -t tmpfs -o mode=1777 tmpfs {r}/tmp",
            f"mount -t tmpfs -o mode=0755 tmpfs {r}/run",
            f"mkdir -p {r}/run/secrets && printf '%s\\n' {KEY} > {r}/run/secrets/api-keys",
            f"chown {uid} {r}/run/secrets/api-keys && chmod 0400 {r}/run/secrets/api-keys",
            *(
                f"mount -t tmpfs -o uid={uid.split(':')[0]},gid={uid.split(':')[-1]},mode=0700 tmpfs {r}{d}"
                for d in (cache_dir, state_dir)
            ),
        ]
    )


def chroot_cmd(root: str, config: dict, argv: list[str], env: dict[str, str]) -> str:
    """A shell command that runs `argv` in the image as its user, in its WorkingDir, with its Env plus `env`."""
    full_env = dict(e.split("=", 1) for e in config.get("Env") or [])
    full_env.update(env)
    inner = ["env", "-i", *[f"{k}={v}" for k, v in full_env.items()], "sh", "-c", 'cd "$0" && exec "$@"']
    inner += [config.get("WorkingDir") or "/", *argv]
    return shlex.join(["chroot", f"--userspec={config.get('User') or '0:0'}", root, *inner])


def in_image(root: str, config: dict, argv: list[str], env: dict[str, str], setup: str) -> list[str]:
    """`chroot_cmd` in new mount and PID namespaces set up by `setup` (what `docker run` would do): the command is
    PID 1 there, as tini is in a container."""
    script = f"{setup}; exec {chroot_cmd(root, config, argv, env)}"
    return ["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--kill-child", "sh", "-c", script]


def pid_one(unshare_pid: int) -> int:
    """The forked PID 1 of `in_image` (host pid), once unshare has forked it."""
    for _ in range(100):
        children = Path(f"/proc/{unshare_pid}/task/{unshare_pid}/children").read_text().split()
        if children:
            return int(children[0])
        time.sleep(0.05)
    sys.exit("smoke: unshare did not fork")


def run_checked(cmd: list[str], what: str, expect_ok: bool = True, timeout: float = 120) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if (done.returncode == 0) != expect_ok:
        sys.exit(f"smoke: {what}: exit {done.returncode}\n{done.stdout}\n{done.stderr}")
    return done.stdout + done.stderr


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default=os.environ.get("IMAGE_TEST_DIR", "/var/tmp/appliance-image-test"))
    parser.add_argument("--image", default=os.environ.get("IMAGE_TAG", "localhost/appliance:test"))
    parser.add_argument("--ready-timeout", type=float, default=300)
    args = parser.parse_args()

    image = json.loads(podman(args.store, "image", "inspect", args.image))[0]
    config = image["Config"]
    root = podman(args.store, "image", "mount", args.image)
    env = dict(e.split("=", 1) for e in config["Env"])
    user, cache = config["User"], env["APPLIANCE_CACHE_DIR"].rsplit("/openvino", 1)[0]
    entry = config["Entrypoint"] + config["Cmd"]
    health = (image.get("Healthcheck") or {}).get("Test") or sys.exit("smoke: the image has no HEALTHCHECK")
    log(f"image {args.image} at {root}: user {user}, entrypoint {entry}, healthcheck {image['Healthcheck']}")
    setup = setup_script(root, user, cache, env["APPLIANCE_STATE_DIR"])

    out = run_checked(in_image(root, config, entry, {}, setup), "default env", expect_ok=False, timeout=60)
    if "no API key is set" not in out:
        sys.exit(f"smoke: the default environment did not refuse the open bind:\n{out}")
    log(f"1. default env refused: {out.strip().splitlines()[-1]}")

    probe = (
        "import importlib.util as u, pathlib, appliance; "
        "assert not [m for m in ('torch', 'transformers', 'optimum') if u.find_spec(m)]; "
        "assert '/site-packages/' in appliance.__file__, appliance.__file__; "
        "assert not list(pathlib.Path('/opt/appliance/lib').glob('python3*/site-packages/__editable__*')); "
        "m = pathlib.Path('/var/lib/appliance/models/smollm2-135m-instruct/openvino-int4/openvino_model.xml'); "
        "open(m, 'a')"
    )
    out = run_checked(in_image(root, config, ["python", "-c", probe], {}, setup), "probe", expect_ok=False)
    if "PermissionError" not in out or "AssertionError" in out:
        sys.exit(f"smoke: the layout probe failed:\n{out}")
    log("2. model read-only to the serving user; no torch/transformers/optimum; appliance non-editable")

    port = free_port()
    serve_env = {"APPLIANCE_HOST": "127.0.0.1", "APPLIANCE_PORT": str(port)}
    serve_env["APPLIANCE_API_KEY_FILE"] = "/run/secrets/api-keys"  # the operator's mount (setup_script)
    server = subprocess.Popen(in_image(root, config, entry, serve_env, setup), start_new_session=True)
    try:
        # the HEALTHCHECK command, inside the server's mount namespace (as `docker exec`)
        init = pid_one(server.pid)
        check = ["nsenter", f"--target={init}", "--mount", "--", "sh", "-c"]
        check.append(chroot_cmd(root, config, health[1:], serve_env))
        deadline = time.monotonic() + args.ready_timeout
        while subprocess.run(check, capture_output=True).returncode != 0:
            if server.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"smoke: not healthy (server exit {server.poll()})")
            time.sleep(1)
        log(f"3. HEALTHCHECK healthy on 127.0.0.1:{port}")
        import openai  # the host's test venv: the real client

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v3", api_key=KEY, max_retries=0)
        t0 = time.monotonic()
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8
        )
        log(f"   completion in {time.monotonic() - t0:.2f}s: {reply.choices[0].message.content!r} ({reply.usage})")
        try:
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v3", api_key="wrong", max_retries=0).models.list()
            sys.exit("smoke: a wrong key was accepted")
        except openai.AuthenticationError:
            log("   wrong key: 401")
        model = client.models.list().data[0].id
        first = client.responses.create(model=model, input="Name a colour.", max_output_tokens=4)
        second = client.responses.create(model=model, input="Another?", previous_response_id=first.id)
        log(f"   stored Responses conversation in the state volume: {first.id} -> {second.id}")
        vectors = client.embeddings.create(model="all-MiniLM-L6-v2", input=["hello"]).data
        log(f"   embeddings: {len(vectors[0].embedding)} dimensions")
    finally:
        t0 = time.monotonic()
        os.kill(pid_one(server.pid), signal.SIGTERM)  # PID 1 of the "container": tini (docker stop)
        code = server.wait(timeout=60)
    log(f"4. SIGTERM: exit {code} in {time.monotonic() - t0:.1f}s")
    return 0 if code in (0, 143, -signal.SIGTERM) else 1


if __name__ == "__main__":
    sys.exit(main())
