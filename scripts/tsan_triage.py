#!/usr/bin/env python3
"""Sorts ThreadSanitizer reports into attnd's own and third-party ones; fails on attnd's own.

    tsan_triage.py --src SOURCE_DIR LOG_DIR

LOG_DIR holds the files TSan wrote with log_path=LOG_DIR/tsan (one per process). Debian's gRPC,
Abseil and protobuf are not built with -fsanitize=thread, so TSan cannot see the locks and
atomics inside them and reports every hand-off of memory between gRPC's threads. TSan's own
suppression language cannot say "both racing accesses are in library code", so this does:

- a frame is attnd's own when its file is under SOURCE_DIR (generated code under SOURCE_DIR/build*
  is protobuf's, not ours), or is a relative path (as ccache's base_dir leaves them) naming a
  file of SOURCE_DIR; frames of the sanitizer runtime, of libstdc++ templates and of
  operator new/delete are skipped to find the first frame that says whose code it is;
- a data race is attnd's own when both accesses are in attnd's code: then TSan can see every
  synchronization between them that matters (our mutexes, and the explicit hand-off
  annotations at the gRPC boundary, server/common/tsan_annotations.h);
- any other report (mutex misuse, lock-order inversion, thread leak, ...) is attnd's own when
  its first stack is.

Prints every report that is attnd's own, counts the rest, exits 1 if there was any of ours.
"""
import argparse
import collections
import os
import re
import sys

FRAME = re.compile(r"^\s+#\d+ (?P<func>.*?)\s*(?P<file>\S+)?\s*\((?P<module>[^()]*)\+0x[0-9a-f]+\)$")
ACCESS = re.compile(r"^  (Previous )?(atomic )?(read|write|Read|Write|Atomic read|Atomic write)",
                    re.IGNORECASE)


def is_skipped(func, path):
    return ("/libsanitizer/" in path or re.match(r"/usr/include/(\w+-linux-gnu/)?c\+\+/", path)
            or func.startswith("operator new") or func.startswith("operator delete"))


class Triage:
    def __init__(self, src):
        # The compiler may have seen the tree by its physical or its logical (symlinked) path.
        self.roots = {os.path.realpath(src) + "/", os.path.abspath(src) + "/"}

    def is_ours(self, path):
        for root in self.roots:
            if path.startswith(root):
                return not path[len(root):].startswith("build")
        if path and not path.startswith("/"):
            # Relative to the compiler's directory (ccache's base_dir makes paths so): ours when
            # the path, less its leading "../", names a file of the source tree.
            rest = re.sub(r"(:\d+)+$", "", path)  # file:line[:column]
            while rest.startswith("../"):
                rest = rest[3:]
            root = next(iter(self.roots))
            return not rest.startswith("build") and os.path.isfile(os.path.join(root, rest))
        return False

    def owner(self, frames):
        """'ours', 'theirs' or None (no frame with a file)."""
        for func, path in frames:
            if is_skipped(func, path):
                continue
            return "ours" if self.is_ours(path) else "theirs"
        return None

    def classify(self, report):
        kind_match = re.search(r"WARNING: ThreadSanitizer: ([^(\n]+)", report)
        kind = kind_match.group(1).strip() if kind_match else "unknown"
        # The report's stacks in order, each as (is it a racing access, its frames).
        stacks = []
        for line in report.splitlines():
            if line.startswith("  ") and not line.startswith("    "):
                stacks.append((bool(ACCESS.match(line)), []))
                continue
            m = FRAME.match(line)
            if m:
                if not stacks:  # frames right under the WARNING line
                    stacks.append((False, []))
                stacks[-1][1].append((m.group("func"), m.group("file") or ""))
        if kind.startswith("data race"):
            owners = [self.owner(frames) for is_access, frames in stacks if is_access]
            return kind, len(owners) >= 2 and all(o == "ours" for o in owners)
        first = next((frames for _, frames in stacks if frames), [])
        return kind, self.owner(first) == "ours"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--src", required=True)
    parser.add_argument("log_dir")
    args = parser.parse_args()
    triage = Triage(args.src)
    theirs = collections.Counter()
    ours = 0
    for name in sorted(os.listdir(args.log_dir)) if os.path.isdir(args.log_dir) else []:
        with open(os.path.join(args.log_dir, name), errors="replace") as f:
            text = f.read()
        for block in text.split("==================\n"):
            if "WARNING: ThreadSanitizer:" not in block:
                continue
            kind, mine = triage.classify(block)
            if mine:
                ours += 1
                print(f"--- attnd's own TSan report ({name}):\n{block}")
            else:
                theirs[kind] += 1
    detail = ", ".join(f"{n} {k}" for k, n in theirs.most_common()) or "none"
    print(f"tsan_triage: {ours} report(s) in attnd's code; "
          f"{sum(theirs.values())} inside or across uninstrumented libraries ({detail})")
    return 1 if ours else 0


if __name__ == "__main__":
    sys.exit(main())
