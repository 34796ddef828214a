"""The scripts under scripts/ (benchmarks and checks) still import against the package: most
run only on a GPU, so nothing else in CPU CI would notice a name they use moving (startup_bench.py
imported the model runner from engine/ for a whole round after the restructure moved it to runner/)."""

import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).parents[1] / "scripts"

# One child process imports every script as `python scripts/NAME.py` would (scripts/ first on sys.path,
# main() not run), so that what they put on sys.path and in sys.modules stays out of the test session.
IMPORT_ALL = """
import importlib.util, pathlib, sys, traceback
scripts = pathlib.Path(sys.argv[1])
sys.path.insert(0, str(scripts))
for path in sorted(scripts.glob("*.py")):
    spec = importlib.util.spec_from_file_location(f"script_{path.stem}", path)
    try:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    except BaseException:
        print(f"{path.name}: {traceback.format_exc(limit=-1).strip()}")
"""


def test_every_script_imports_on_cpu() -> None:
    assert len(list(SCRIPTS.glob("*.py"))) > 10
    done = subprocess.run([sys.executable, "-c", IMPORT_ALL, str(SCRIPTS)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "", f"scripts that fail to import:\n{done.stdout}"


def test_every_script_has_a_line_in_the_readme() -> None:
    """scripts/ holds what users and maintainers run, and README's "Scripts" list says what each is for;
    a one-off probe belongs in docs/performance-notes.md (its result, with the commit), not here."""
    readme = (SCRIPTS.parent / "README.md").read_text()
    listed = readme.split("\n## Scripts\n", 1)[1].split("\n## ", 1)[0]
    missing = sorted(path.name for path in SCRIPTS.glob("*.py") if f"scripts/{path.name}" not in listed)
    assert not missing, f"scripts without a line in README's Scripts list: {missing}"
