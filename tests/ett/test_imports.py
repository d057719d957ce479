"""What a script imported, as the library says it for its job's warm restarts (ett/imports.py): a
real script in a folder of its own, run as a fresh interpreter, inside a (one-rank) job whose agent
asks for it."""

import json
import os
import subprocess
import sys

from ett.protocol import IMPORTS_FILE, JobEnv

SCRIPT = """
import sys
sys.path.insert(0, sys.argv[1])  # a folder the script puts on the path itself
import idna        # an installed package
import mylocal     # the job's own module, beside the script
import certifi     # the job's own too: a file beside the script named like an installed package
import extra_mod   # from the folder the script added
import os
import ett
with ett.init() as run:
    # Said at once, before any step: a warm server of them imports while the script builds and trains.
    said = os.path.exists(os.path.join(os.environ["ETT_EVENT_DIR"], "imports.json"))
    assert said == (os.environ["LOCAL_RANK"] == "0")
    for step in (1, 2):
        with run.step(step):
            pass
"""


def run_script(tmp_path, local_rank: int) -> list[str] | None:
    job, extra, events = tmp_path / "job", tmp_path / "extra", tmp_path / f"events-{local_rank}"
    for folder in (job, extra, events):
        folder.mkdir(exist_ok=True)
    (job / "train.py").write_text(SCRIPT)
    for module in (job / "mylocal.py", job / "certifi.py", extra / "extra_mod.py"):
        module.write_text("VALUE = 1\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETT_")} | {
        JobEnv.JOB_ID: "learner", JobEnv.EVENT_DIR: str(events), JobEnv.LEARN_IMPORTS: "1",
        "LOCAL_RANK": str(local_rank)}  # fmt: skip
    done = subprocess.run([sys.executable, str(job / "train.py"), str(extra)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    path = events / IMPORTS_FILE
    return json.loads(path.read_text())["modules"] if path.exists() else None


def test_the_installed_modules_a_script_loaded_are_said_and_never_its_own(tmp_path):
    names = run_script(tmp_path, local_rank=0)
    assert names is not None, "no list written at ett.init"
    tops = {name.partition(".")[0] for name in names}
    assert "idna" in tops and "torch" in tops
    assert "ett" in tops  # an editable install: found by its own finder, as the warm server finds it
    assert not tops & {"mylocal", "certifi", "extra_mod", "__main__", "train"}, tops & {"mylocal", "certifi"}
    # Leaves only (importing one imports its parents), each once.
    assert len(names) == len(set(names)) and not any(other.startswith(name + ".") for name in names for other in names)


def test_only_each_nodes_local_rank_0_says_it(tmp_path):
    assert run_script(tmp_path, local_rank=1) is None
