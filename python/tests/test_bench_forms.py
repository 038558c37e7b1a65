"""python/bench/forms.py keeps working: its command line, the environment each run gets, the
rounds' order and the summary, with a stand-in for profile_layer.py that prints the JSON line
profile_layer.py prints (its numbers from the environment it was given)."""

import json
import pathlib

import pytest

from scripts import load_script

FORMS = pathlib.Path(__file__).resolve().parents[1] / "bench" / "forms.py"

STUB = '''
import json, os, sys
bie = float(os.environ.get("FORM_US", "100"))
if os.environ.get("FORM_FAIL"):
    sys.exit(3)
print("   12.0   1.0  some_kernel")
print(json.dumps({"bench": "profile_layer", "bie_graph_us": bie, "torch_bf16_graph_us": 110.0,
                  "ratio": round(110.0 / bie, 3), "args": sys.argv[1:]}))
'''


@pytest.fixture(scope="module")
def forms():
    return load_script(FORMS)


def last_json(text):
    return json.loads(text.strip().splitlines()[-1])


def test_settings_rounds_and_summary(forms, tmp_path, capsys):
    stub = tmp_path / "profile_stub.py"
    stub.write_text(STUB)
    rc = forms.main(["--rounds", "2", "--layer", "q4linear", "--", "", "FORM_US=80 OTHER=1"],
                    script=stub)
    assert rc == 0
    out = capsys.readouterr().out
    runs = last_json(out)["runs"]
    assert [(r["round"], r["setting"]) for r in runs] == [
        (1, ""), (1, "FORM_US=80 OTHER=1"), (2, ""), (2, "FORM_US=80 OTHER=1")]
    assert [r["result"]["bie_graph_us"] for r in runs] == [100.0, 80.0, 100.0, 80.0]
    assert all(r["result"]["args"] == ["--layer", "q4linear"] for r in runs)
    assert "some_kernel" in out  # each run's own output is shown
    # the summary: the second setting 1.25x the first in its round
    rows = [line for line in out.splitlines() if line.startswith("FORM_US=80")]
    assert len(rows) == 2 and all(row.split()[-1] == "1.250" for row in rows)


def test_failed_run_and_bad_arguments(forms, tmp_path, capsys):
    stub = tmp_path / "profile_stub.py"
    stub.write_text(STUB)
    assert forms.main(["--", "", "FORM_FAIL=1"], script=stub) == 1
    runs = last_json(capsys.readouterr().out)["runs"]
    assert runs[0]["result"]["bie_graph_us"] == 100.0 and runs[1]["result"] is None
    for bad in (["--layer", "linear"], ["--"], ["--", "NOEQUALS"], ["--rounds", "0", "--", ""]):
        assert forms.main(bad, script=stub) == 2
        assert "forms:" in capsys.readouterr().err
