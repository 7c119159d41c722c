"""Where the test suite's time goes: a JUnit XML report summed by file and by tier.

    python -m pytest --junitxml=/tmp/junit.xml            # any run (pytest-xdist included)
    python tools/test_durations.py /tmp/junit.xml [more.xml ...] [--top 25] [--tests 15]

The tier of each test (`slow` or not) is read from a `pytest --collect-only -m slow` of the same
tree, so the table says what `-m "not slow"` would cost. Durations are the test's own (set-up,
call and teardown, as pytest reports them): a session fixture's cost lands on the first test that
asks for it. Under xdist the sum is CPU-side work spread over workers, not the wall time.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def slow_node_ids() -> set[str]:
    """The node ids `-m slow` selects, as `path::name[params]`."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "slow", "-p", "no:cacheprovider"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False).stdout
    return {line.strip() for line in out.splitlines() if "::" in line}


def read_cases(junit: Path) -> list[tuple[str, float]]:
    """(node id, seconds) for every test case of the report."""
    cases = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        # A test inside a class has the class as the classname's last part.
        cut = next((i for i in range(len(parts), 0, -1) if (REPO / "/".join(parts[:i])).with_suffix(".py").is_file()),
                   len(parts))
        path = "/".join(parts[:cut]) + ".py"
        name = "::".join([*parts[cut:], case.get("name", "")])
        cases.append((f"{path}::{name}", float(case.get("time", 0.0))))
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", type=Path, nargs="+", help="JUnit reports of one run (parts of it, summed)")
    parser.add_argument("--top", type=int, default=25, help="files to list (default 25)")
    parser.add_argument("--tests", type=int, default=15, help="slowest single tests to list (default 15)")
    args = parser.parse_args()
    cases = [case for report in args.junit for case in read_cases(report)]
    slow = slow_node_ids()
    by_file: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    tiers = {"slow": [0.0, 0], "not slow": [0.0, 0]}
    for node, seconds in cases:
        tier = "slow" if node in slow else "not slow"
        tiers[tier][0] += seconds
        tiers[tier][1] += 1
        row = by_file[node.split("::")[0]]
        row[0 if tier == "slow" else 1] += seconds
        row[2] += 1
    total = sum(t[0] for t in tiers.values())
    print(f"{len(cases)} tests, {total / 60:.1f} min of test time\n")
    print("| tier | tests | minutes | share |\n|---|---|---|---|")
    for name, (seconds, count) in tiers.items():
        print(f"| {name} | {count} | {seconds / 60:.1f} | {seconds / total:.0%} |")
    print("\n| file | tests | slow (s) | not slow (s) | share |\n|---|---|---|---|---|")
    for path, (s, f, n) in sorted(by_file.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))[: args.top]:
        print(f"| {path} | {n} | {s:.0f} | {f:.0f} | {(s + f) / total:.1%} |")
    print("\n| slowest tests | seconds | tier |\n|---|---|---|")
    for node, seconds in sorted(cases, key=lambda c: -c[1])[: args.tests]:
        print(f"| {node} | {seconds:.1f} | {'slow' if node in slow else 'not slow'} |")


if __name__ == "__main__":
    main()
