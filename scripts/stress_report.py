"""Reads the JUnit XML that scripts/stress wrote for each round and reports every
test that failed at least once: a line each (how often, in which rounds), then the
output of each failure. Exit status 1 if anything failed, or a round left no XML
(its runner died or timed out as a whole).

    python3 scripts/stress_report.py OUT RUNS SUITE
"""
import collections
import os
import sys
import xml.etree.ElementTree as ElementTree


def failures(path):
    """(test name, output) for each failed or errored case of one JUnit file."""
    root = ElementTree.parse(path).getroot()
    for case in root.iter("testcase"):
        bad = [e for e in case if e.tag in ("failure", "error")]
        if not bad:
            continue
        name = "::".join(p for p in (case.get("classname"), case.get("name")) if p)
        text = []
        for element in bad:
            text.append(element.get("message") or "")
            text.append(element.text or "")
        for element in case:
            if element.tag in ("system-out", "system-err") and element.text:
                text.append(element.text)
        yield name, "\n".join(t for t in text if t.strip())


def main(out, runs, suite):
    runners = {"all": ("ctest", "pytest"), "ctest": ("ctest",), "pytest": ("pytest",)}[suite]
    rounds = collections.defaultdict(list)
    outputs = []
    missing = []
    for runner in runners:
        for r in range(1, runs + 1):
            path = os.path.join(out, "%s-%d.xml" % (runner, r))
            if not os.path.exists(path) or os.path.getsize(path) == 0:
                log = os.path.join(out, "%s-%d.log" % (runner, r))
                missing.append("%s round %d (see %s)" % (runner, r, log))
                continue
            for name, text in failures(path):
                rounds["%s: %s" % (runner, name)].append(r)
                outputs.append((name, r, text))
    if not rounds and not missing:
        print("stress: no test failed in %d rounds (%s)" % (runs, ", ".join(runners)))
        return 0
    print("stress: tests that failed at least once in %d rounds:" % runs)
    for name, where in sorted(rounds.items(), key=lambda kv: -len(kv[1])):
        print("  %d/%d  %s  (rounds %s)" % (len(where), runs, name, ", ".join(map(str, where))))
    for what in missing:
        print("  no result: %s" % what)
    for name, r, text in outputs:
        print("\n----- %s, round %d -----" % (name, r))
        # The tail holds the assertion; ctest's full log is beside the XML.
        lines = text.splitlines()
        print("\n".join(lines[-80:]))
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
