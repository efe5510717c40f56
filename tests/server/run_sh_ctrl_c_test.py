#!/usr/bin/env python3
"""scripts/run.sh in a pseudo-terminal, stopped with Ctrl-C as a person would.

The terminal sends SIGINT to the whole foreground process group (run.sh and attnd):
- one Ctrl-C: attnd drains and exits 0, run.sh exits 0, nothing treats it as a second signal;
- Ctrl-C twice (the drain held open by a long quiet period): attnd exits at once with 130 and
  run.sh with it.

usage: run_sh_ctrl_c_test.py REPO_ROOT BUILD_DIR
"""
import os
import pty
import select
import signal
import socket
import sys
import time

ROOT, BUILD = sys.argv[1], sys.argv[2]
SLOW = 3 if os.environ.get("ATTN_SANITIZER") else 1


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunSh:
    def __init__(self, extra_flags):
        args = ["bash", os.path.join(ROOT, "scripts/run.sh"),
                f"--listen=127.0.0.1:{free_port()}", f"--metrics_listen=127.0.0.1:{free_port()}",
                "--backend=cpu", "--threads=2"] + extra_flags
        env = dict(os.environ, ATTN_RUN_SKIP_BUILD="1", ATTN_BUILD_DIR=BUILD)
        self.pid, self.fd = pty.fork()
        if self.pid == 0:
            os.execvpe(args[0], args, env)
        self.out = ""
        self.status = None

    def read_until(self, text, timeout):
        """Reads terminal output until text appears; False when the timeout or EOF comes first."""
        end = time.monotonic() + timeout
        while text not in self.out:
            left = end - time.monotonic()
            if left <= 0:
                return False
            ready, _, _ = select.select([self.fd], [], [], left)
            if not ready:
                continue
            try:
                chunk = os.read(self.fd, 4096)
            except OSError:  # EIO: the terminal's last process is gone
                return text in self.out
            if not chunk:
                return text in self.out
            self.out += chunk.decode(errors="replace")
        return True

    def ctrl_c(self):
        os.write(self.fd, b"\x03")  # the terminal's interrupt character: SIGINT to the group

    def wait(self, timeout):
        """run.sh's exit status (128 + signal if killed), or None after the timeout."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.read_until("\0never\0", 0.05)  # keep the terminal drained
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid == self.pid:
                # What the terminal still holds (the last lines can outrun the reads above on a
                # loaded machine): read to its end.
                self.read_until("\0never\0", 5)
                self.status = os.waitstatus_to_exitcode(status)
                if self.status < 0:
                    self.status = 128 - self.status
                return self.status
        return None

    def kill(self):
        if self.status is None:
            os.killpg(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)


failures = []


def check(ok, what, run):
    if not ok:
        failures.append(what + "\n--- terminal output ---\n" + run.out + "\n---")


def start_serving(extra_flags):
    """run.sh serving on free ports, and True; or the last try and False. run.sh needs ports it can
    name to its clients, so they are picked beforehand: when another test's connection takes one
    before attnd binds it, attnd exits and the start is tried again on others."""
    for _ in range(3):
        run = RunSh(extra_flags)
        if run.read_until("Ctrl-C drains and stops it", 120 * SLOW):
            return run, True
        if "run.sh: attnd exited" not in run.out:
            return run, False
        run.wait(10)
        run.kill()
    return run, False


def one_ctrl_c():
    run, up = start_serving([])
    try:
        check(up, "run.sh did not reach serving", run)
        if not up:
            return
        run.ctrl_c()
        status = run.wait(60 * SLOW)
        check(status == 0, f"one Ctrl-C: run.sh exit status {status}, want 0", run)
        check("received Interrupt; draining" in run.out, "attnd did not drain on Ctrl-C", run)
        check("attnd: exiting" in run.out, "attnd did not finish its drain", run)
        check("again while draining" not in run.out,
              "attnd saw a second signal after one Ctrl-C", run)
    finally:
        run.kill()


def two_ctrl_c():
    # A quiet period longer than the test keeps the drain in its lame-duck phase.
    run, up = start_serving(["--drain_quiet_ms=600000", "--drain_grace_s=600"])
    try:
        check(up, "run.sh did not reach serving", run)
        if not up:
            return
        run.ctrl_c()
        check(run.read_until("attnd: draining:", 30 * SLOW), "attnd did not start draining", run)
        start = time.monotonic()
        run.ctrl_c()
        status = run.wait(30 * SLOW)
        took = time.monotonic() - start
        check(status == 130, f"two Ctrl-C: run.sh exit status {status}, want 130", run)
        check(took < 10 * SLOW, f"the second Ctrl-C took {took:.1f} s to end attnd", run)
        check("again while draining; exiting at once" in run.out,
              "attnd did not report the second signal", run)
    finally:
        run.kill()


one_ctrl_c()
two_ctrl_c()
for f in failures:
    print("FAIL:", f)
if failures:
    sys.exit(1)
print("PASS: one Ctrl-C drains and exits 0, a second one exits at once with 130")
