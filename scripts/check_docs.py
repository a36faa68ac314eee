#!/usr/bin/env python3
"""Runs the commands that README.md, docs/ and deploy/README.md show, as written.

    python3 scripts/check_docs.py --tally-bin target/debug/tally      (make doc-commands)

Every fenced block of shell (sh, bash, shell, console) says in its info string whether it is
run here: `runnable` (run on the embedded store), `runnable celeriant` (run beside a Celeriant
server), or `manual` (not run here: it needs what a test machine has not, such as docker or a
cluster, or runs until Ctrl-C; the prose says so). A shell block that says neither fails the
check, so a command added to the docs is run or knowingly left out.

How a block runs:
- In a directory of its own that holds the repository's top-level entries (links), so
  `make run` and `deploy/...` work and files a block writes (`dev.secret`) go nowhere else.
- In network and PID namespaces of its own (`unshare`) where the system allows them: port
  8080 is free whatever else the machine runs, and every process the block started ends with
  it. Elsewhere it runs in a session of its own, ended with the block, and needs 8080 free.
- `cargo` is a stand-in that runs the already built binary for `cargo run ... --bin tally`
  (and links it as target/release/tally for `cargo build --release`): the check takes
  seconds, not a release build; the command line is the one the reader types.
- A `runnable celeriant` block gets a throwaway Celeriant server at 127.0.0.1:10000 (the
  standalone server of Celeriant's README; also exported as CELERIANT_ADDRESS), from
  CELERIANT_BIN or ../shared/celeriant/celeriant. Without one such a block is skipped, and
  under CI=true that fails the check.
- A command sent to the background (`... &`) is a server: the next command runs once its
  /readyz answers 200 (at its `--listen` or `TALLY_LISTEN`, else 127.0.0.1:8080), as the
  reader waits for its `tally listening` line.
- In a console block, lines after a `$ ` command are its output, compared with what the
  command printed (a `date` and a `content-length` header left out, as the README says).
  A command's non-zero exit status fails the block.
"""

import argparse
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHELL_LANGS = {"sh", "bash", "shell", "console"}
MARKERS = {"runnable", "manual"}
# How long a background server may take to answer /readyz 200.
READY_TIMEOUT_SECS = 60
# How long one block may run in all.
BLOCK_TIMEOUT_SECS = 180
# How long a block's leftover processes get to stop after SIGTERM, before SIGKILL.
STOP_TIMEOUT_SECS = 10
# Where the docs point Tally at Celeriant: a standalone server on loopback.
CELERIANT_PORT = 10000
# Output headers the docs leave out of what they show (they change on every run).
UNSHOWN_HEADERS = re.compile(r"^(date|content-length):", re.IGNORECASE)


@dataclass
class Command:
    text: str
    # The output the docs show for it; None when they show none (then it is not compared).
    expected: list = field(default_factory=list)

    def background(self):
        return re.search(r"(?<![&|])&\s*(#.*)?$", self.text.splitlines()[-1]) is not None

    def listen_address(self):
        found = re.findall(r"(?:--listen[ =]|TALLY_LISTEN=)['\"]?([\w.:\[\]-]+:\d+)", self.text)
        return found[-1] if found else "127.0.0.1:8080"


@dataclass
class Block:
    path: str
    line: int
    lang: str
    words: list
    body: list

    def where(self):
        return f"{self.path}:{self.line}"

    def commands(self):
        """The block's commands: a console block's `$ ` lines (with their continuations) and
        the output shown after each; a script's lines (with continuations), output unshown."""
        commands = []
        lines = iter(self.body)
        for line in lines:
            if self.lang == "console":
                if not line.startswith("$"):
                    if commands:
                        commands[-1].expected.append(line)
                    continue
                text = line[1:].lstrip()
            else:
                if not line.strip():
                    continue
                text = line
            while text.endswith("\\"):
                text += "\n" + next(lines, "")
            if "\n" not in text and text.lstrip().startswith("#"):
                # A comment in the reader's session: nothing runs, and nothing is printed.
                commands.append(Command(":"))
                continue
            commands.append(Command(text))
        for c in commands:
            while c.expected and not c.expected[-1].strip():
                c.expected.pop()
        return commands


def markdown_files():
    files = ["README.md", "deploy/README.md"]
    for base, _, names in os.walk(os.path.join(ROOT, "docs")):
        files += sorted(os.path.relpath(os.path.join(base, n), ROOT) for n in names if n.endswith(".md"))
    return files


def blocks(path):
    found, fence, start, info, body = [], None, 0, "", []
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        for number, line in enumerate(f.read().splitlines(), 1):
            m = re.match(r"^(`{3,})(.*)$", line)
            if fence is None and m:
                fence, start, info, body = m.group(1), number, m.group(2).strip(), []
            elif fence is not None and line.strip() == fence:
                words = info.split()
                found.append(Block(path, start, words[0] if words else "", words[1:], body))
                fence = None
            elif fence is not None:
                body.append(line)
    return found


def cargo_stand_in(tally):
    return f"""#!/usr/bin/env bash
# cargo, as scripts/check_docs.py runs the docs: the tally binary already built stands in
# for `cargo run ... --bin tally` and `cargo build --release`.
set -euo pipefail
tally={shlex.quote(tally)}
sub=${{1:-}}
[ $# -gt 0 ] && shift
bin=""
args=()
while [ $# -gt 0 ]; do
    case $1 in
    --) shift; args=("$@"); break ;;
    --bin) bin=${{2:-}}; shift 2 ;;
    --release | -q | --quiet | --locked | --offline) shift ;;
    *) echo "check_docs: its cargo takes only run/build --bin tally; got '$1'" >&2; exit 97 ;;
    esac
done
case $sub in
run)
    [ "$bin" = tally ] || {{ echo "check_docs: its cargo runs only --bin tally" >&2; exit 97; }}
    exec "$tally" "${{args[@]}}" ;;
build)
    mkdir -p target/release && ln -sf "$tally" target/release/tally ;;
*) echo "check_docs: its cargo takes only run and build; got '$sub'" >&2; exit 97 ;;
esac
"""


# Brings the loopback interface up in a fresh network namespace (SIOCSIFFLAGS: IFF_UP |
# IFF_LOOPBACK | IFF_RUNNING), without needing `ip`.
LOOPBACK_UP = (
    "import fcntl, socket, struct; "
    "s = socket.socket(); "
    "fcntl.ioctl(s.fileno(), 0x8914, struct.pack('16sH14x', b'lo', 0x1 | 0x8 | 0x40))"
)


def script_for(block, out_dir, celeriant_bin):
    """The bash script that runs a block's commands one by one, each output kept apart."""
    q = shlex.quote
    # As a reader's shell runs them: no `set -u` or `-e` (an unset variable is empty there).
    lines = [
        f"out={q(out_dir)}",
        "wait_ready() {",
        f"    local addr=$1 pid=$2 deadline=$((SECONDS + {READY_TIMEOUT_SECS}))",
        "    until curl -sf -o /dev/null \"http://$addr/readyz\"; do",
        "        kill -0 \"$pid\" 2>/dev/null || { echo \"it exited before http://$addr/readyz answered 200\"; return 1; }",
        "        ((SECONDS < deadline)) || { echo \"http://$addr/readyz did not answer 200 within "
        f"{READY_TIMEOUT_SECS}s\"; return 1; }}",
        "        sleep 0.1",
        "    done",
        "}",
    ]
    if "celeriant" in block.words:
        lines += [
            f"mkdir -p \"$out/celeriant-data\"",
            f"CELERIANT_METRICS_ENABLED=false {q(celeriant_bin)} --standalone --data-root \"$out/celeriant-data\" "
            f"--routing-rule aggregate_type_id --listen-address 127.0.0.1 --client-port {CELERIANT_PORT} "
            f"--replication-port {CELERIANT_PORT + 1} >\"$out/celeriant.log\" 2>&1 &",
            "celeriant=$!",
            f"deadline=$((SECONDS + {READY_TIMEOUT_SECS}))",
            f"until (exec 3<>/dev/tcp/127.0.0.1/{CELERIANT_PORT}) 2>/dev/null; do",
            "    kill -0 \"$celeriant\" 2>/dev/null && ((SECONDS < deadline)) || "
            "{ echo 'the Celeriant server did not start' >\"$out/setup\"; tail -n 20 \"$out/celeriant.log\" >>\"$out/setup\"; exit 4; }",
            "    sleep 0.1",
            "done",
            f"export CELERIANT_ADDRESS=127.0.0.1:{CELERIANT_PORT}",
        ]
    for i, c in enumerate(block.commands()):
        lines += ["{", c.text, f"}} >\"$out/{i}.out\" 2>\"$out/{i}.err\""]
        if c.background():
            lines += [
                "bg=$!",
                f"wait_ready {q(c.listen_address())} \"$bg\" >\"$out/{i}.wait\" 2>&1",
                f"echo $? >\"$out/{i}.rc\"",
            ]
        else:
            lines += [f"echo $? >\"$out/{i}.rc\""]
        lines += [f"[ \"$(cat \"$out/{i}.rc\")\" = 0 ] || exit 3"]
    return "\n".join(lines) + "\n"


def namespaces_work():
    try:
        probe = subprocess.run(
            ["unshare", "-rnpf", "--mount-proc", "python3", "-c", LOOPBACK_UP],
            capture_output=True, timeout=30)
        return probe.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def port_free(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def run_block(block, env, celeriant_bin, isolated):
    """Runs one block; returns a list of problems (empty: it ran as written)."""
    work = tempfile.mkdtemp(prefix="tally-docs.")
    try:
        for name in os.listdir(ROOT):
            if name not in ("target", ".git"):
                os.symlink(os.path.join(ROOT, name), os.path.join(work, name))
        out = os.path.join(work, ".out")
        os.mkdir(out)
        script = os.path.join(out, "block.sh")
        with open(script, "w", encoding="utf-8") as f:
            f.write(script_for(block, out, celeriant_bin))
        if isolated:
            argv = ["unshare", "-rnpf", "--mount-proc", "bash", "-c",
                    f"python3 -c {shlex.quote(LOOPBACK_UP)} && exec bash {shlex.quote(script)}"]
        else:
            ports = [8080] + ([CELERIANT_PORT, CELERIANT_PORT + 1] if "celeriant" in block.words else [])
            busy = [p for p in ports if not port_free(p)]
            if busy:
                return [f"port(s) {busy} in use, and the docs' commands use them (no namespaces here to isolate them)"]
            argv = ["bash", script]
        proc = subprocess.Popen(argv, cwd=work, env=env, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            _, stderr = proc.communicate(timeout=BLOCK_TIMEOUT_SECS)
        except subprocess.TimeoutExpired:
            stop_session(proc)
            return [f"did not finish within {BLOCK_TIMEOUT_SECS}s"]
        finally:
            stop_session(proc)
        return problems_of(block, out, proc.returncode, stderr.decode(errors="replace"))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def stop_session(proc):
    """Ends what the block left running, by the process group it was started in (in
    namespaces, its processes end with its first one already): TERM, then KILL what is left
    after a bound."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + STOP_TIMEOUT_SECS
        while time.monotonic() < deadline and group_alive(proc.pid):
            time.sleep(0.05)
        if not group_alive(proc.pid):
            break
    if proc.poll() is None:
        proc.wait()


def group_alive(pgid):
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def read(path):
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except FileNotFoundError:
        return None


def shown(text):
    """Output as the docs show it: LF line ends, no `date`/`content-length` header, no
    trailing blank lines."""
    lines = [l for l in text.replace("\r\n", "\n").split("\n") if not UNSHOWN_HEADERS.match(l)]
    return "\n".join(lines).rstrip()


def problems_of(block, out, status, stderr):
    setup = read(os.path.join(out, "setup"))
    if setup:
        return [setup.strip()]
    for i, c in enumerate(block.commands()):
        rc = read(os.path.join(out, f"{i}.rc"))
        head = f"command {i + 1}: {c.text.splitlines()[0]}"
        if rc is None:
            errors = (read(os.path.join(out, f"{i}.err")) or "").strip()
            return [f"{head}: did not finish (the block's shell ended with status {status}): "
                    f"{errors[:2000]} {stderr.strip()[:2000]}"]
        output = read(os.path.join(out, f"{i}.out")) or ""
        errors = (read(os.path.join(out, f"{i}.err")) or "").strip()
        if rc.strip() != "0":
            waited = (read(os.path.join(out, f"{i}.wait")) or "").strip()
            return [f"{head}: exit status {rc.strip()}\n  stdout: {output.strip()[:2000]}\n"
                    f"  stderr: {errors[:2000]}" + (f"\n  {waited}" if waited else "")]
        if c.expected and shown(output) != shown("\n".join(c.expected)):
            return [f"{head}: output differs from the docs\n--- docs\n{shown(chr(10).join(c.expected))}\n"
                    f"--- printed\n{shown(output)}\n--- stderr\n{errors[:2000]}"]
    return []


def ensure_tools():
    missing = [t for t in ("curl", "jq") if shutil.which(t) is None]
    if missing and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "update", "-qq"], check=False)
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing], check=False)
        missing = [t for t in missing if shutil.which(t) is None]
    if missing:
        sys.exit(f"check_docs: the docs' commands need {' and '.join(missing)}; install them")


def block_env(bin_dir):
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith(("TALLY_", "CARGO", "CELERIANT_", "FLEET_"))
                   or k in ("RUST_LOG", "MAKEFLAGS", "MAKELEVEL", "MFLAGS", "DATABASE_URL"))}
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    return env


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tally-bin", required=True, help="the tally binary the docs' cargo runs")
    parser.add_argument("--only", help="run only the blocks of this file (e.g. README.md)")
    args = parser.parse_args()
    tally = os.path.abspath(args.tally_bin)
    if not os.access(tally, os.X_OK):
        sys.exit(f"check_docs: no tally binary at {tally}")
    ensure_tools()
    celeriant_bin = os.environ.get("CELERIANT_BIN") or os.path.join(ROOT, "..", "shared", "celeriant", "celeriant")
    have_celeriant = os.access(celeriant_bin, os.X_OK)
    isolated = namespaces_work()
    if not isolated:
        print("check_docs: no network namespaces here; blocks share this machine's ports")

    all_blocks = [b for p in markdown_files() for b in blocks(p)
                  if b.lang in SHELL_LANGS and (args.only is None or b.path == args.only)]
    failures, ran, skipped = [], 0, 0
    unmarked = [b for b in all_blocks if not MARKERS & set(b.words)]
    for b in unmarked:
        failures.append(f"{b.where()}: a {b.lang} block that says neither `runnable` nor `manual`")
    runnable = [b for b in all_blocks if "runnable" in b.words]
    if args.only in (None, "README.md") and not any(b.path == "README.md" for b in runnable):
        failures.append("README.md has no runnable block: its session is no longer checked")

    with tempfile.TemporaryDirectory(prefix="tally-docs-bin.") as bin_dir:
        cargo = os.path.join(bin_dir, "cargo")
        with open(cargo, "w", encoding="utf-8") as f:
            f.write(cargo_stand_in(tally))
        os.chmod(cargo, 0o755)
        env = block_env(bin_dir)
        for b in runnable:
            if "celeriant" in b.words and not have_celeriant:
                why = f"no Celeriant server binary at {celeriant_bin} (set CELERIANT_BIN)"
                if os.environ.get("CI") == "true":
                    failures.append(f"{b.where()}: CI=true needs every block run, and {why}")
                else:
                    print(f"skipped {b.where()}: {why}")
                    skipped += 1
                continue
            problems = run_block(b, env, celeriant_bin, isolated)
            ran += 1
            if problems:
                failures += [f"{b.where()}: {p}" for p in problems]
                print(f"FAILED {b.where()}")
            else:
                print(f"ok     {b.where()} ({b.lang}{' on Celeriant' if 'celeriant' in b.words else ''}, "
                      f"{len(b.commands())} commands)")
    manual = [b.where() for b in all_blocks if "manual" in b.words]
    print(f"{ran} block(s) run, {skipped} skipped, {len(manual)} manual ({', '.join(manual)})")
    if failures:
        print("\n".join(["", *failures]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
