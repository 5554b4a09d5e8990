"""Print the mutation score and the surviving mutants of the last ``mutmut run``.

Reads ``mutants/mutmut-cicd-stats.json`` (written by ``mutmut export-cicd-stats``)
and the survivors from ``mutmut results``. Usage: ``python .ci/mutation_score.py [mutmut]``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def main() -> int:
    mutmut = sys.argv[1] if len(sys.argv) > 1 else "mutmut"
    subprocess.run([mutmut, "export-cicd-stats"], check=True, stdout=subprocess.DEVNULL)
    stats = json.loads(Path("mutants/mutmut-cicd-stats.json").read_text())
    lines = subprocess.run([mutmut, "results"], check=True, capture_output=True, text=True).stdout.splitlines()
    survivors = [ln.strip() for ln in lines if ln.strip().endswith(": survived")]
    by_module: dict[str, list[int]] = {}
    for ln in subprocess.run(
        [mutmut, "results", "--all", "true"], check=True, capture_output=True, text=True
    ).stdout.splitlines():
        name, _, status = ln.strip().rpartition(": ")
        if not name:
            continue
        parts = name.split(".")
        module = ".".join(p for p in parts[: next((i for i, p in enumerate(parts) if p.startswith("x")), 1)])
        counts = by_module.setdefault(module, [0, 0, 0])  # killed, tested, all
        counts[2] += 1
        if status in ("killed", "survived", "timeout"):
            counts[1] += 1
            counts[0] += status != "survived"
    killed, survived = stats.get("killed", 0) + stats.get("timeout", 0), stats.get("survived", 0)
    tested = killed + survived
    print("mutation score per module (killed / tested):")
    for module, (k, t, a) in sorted(by_module.items()):
        score = f"{100 * k / t:5.1f} %" if t else "not run"
        print(f"  {module:22s} {k:4d} / {t:4d}  {score}" + (f"  ({a - t} of {a} not run)" if a > t else ""))
    print(
        f"total: {killed} killed, {survived} survived, {stats.get('no_tests', 0)} not reached by the fast tests, "
        f"score {100 * killed / tested if tested else 0:.1f} % of the mutants run "
        f"(timeouts count as killed: {stats.get('timeout', 0)})"
    )
    if survivors:
        print("survivors (mutmut show NAME):")
        for s in survivors:
            print("  " + s.removesuffix(": survived"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
