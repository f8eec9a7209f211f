"""provenance.json's command line for a module run started with any interpreter options."""

import json
import subprocess
import sys


def test_a_module_run_after_options_with_their_own_arguments_is_recorded_as_python_dash_m(tmp_path):
    """``python -X dev -W ignore -m mod``: "-m" was looked for among the first two arguments only, and the
    record held the module file's path instead of the module."""
    (tmp_path / "qa8_mod2.py").write_text("import sys; from eaglenest.provenance import write_provenance; "
                                          "write_provenance(sys.argv[1], config={})")
    for opts in (["-X", "dev", "-W", "ignore"], ["-X", "utf8", "-u"], []):
        out = tmp_path / f"out{len(opts)}"
        subprocess.run([sys.executable, *opts, "-m", "qa8_mod2", str(out), "-m", "x"], cwd=tmp_path, check=True)
        argv = json.loads((out / "provenance.json").read_text())["argv"]
        assert argv == ["python", "-m", "qa8_mod2", str(out), "-m", "x"], opts
