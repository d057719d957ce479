"""A job's checkpoints stay in its owner's area: the default folder is <root>/<owner>/<job id>,
and a folder the job names must resolve inside <root>/<owner>, else 422 naming checkpoint.dir."""

import os

import pytest

from service.jobs.checkpoints import owner_area
from tests.service.factories import job_spec


def submit_dir(client, folder) -> object:
    return client.post("/api/v1/jobs", json=job_spec(checkpoint={"interval_steps": 5, "keep": 2, "dir": str(folder)}))


@pytest.fixture
def alice(service):
    return service.client(service.token("user", "alice"))


def test_a_folder_inside_the_owners_area_is_accepted_resolved(service, alice):
    area = service.context.settings.resolved_checkpoint_root / "alice"
    response = submit_dir(alice, f"{area}/runs/../mine")
    assert response.status_code == 201, response.text
    assert response.json()["spec"]["checkpoint"]["dir"] == str(area / "mine")


def test_folders_outside_the_owners_area_are_refused_naming_the_field(service, alice, tmp_path):
    root = service.context.settings.resolved_checkpoint_root
    (root / "alice").mkdir(parents=True, exist_ok=True)
    os.symlink("/etc", root / "alice" / "link-out")  # a link laid in the area, pointing out of it
    for folder in (f"{root}/alice/../bob/x",  # `..` out of the area
                   root / "alice" / "link-out" / "ckpt",  # through the link
                   root / "bob" / "ckpt",  # another owner's area
                   "/etc/ett-probe", "/tmp/../etc",  # system folders
                   root):  # the root itself, above every area
        response = submit_dir(alice, folder)
        assert response.status_code == 422, (folder, response.text)
        [problem] = response.json()["detail"]
        assert problem["field"] == "checkpoint.dir" and "outside" in problem["msg"] and "alice" in problem["msg"]
    assert alice.get("/api/v1/jobs").json()["total"] == 0  # nothing was stored


def test_an_owner_name_unfit_for_a_folder_gets_a_folder_of_its_own(settings):
    odd = owner_area(settings, "../eve")
    assert odd.parent == settings.resolved_checkpoint_root and odd.name.startswith("owner-")
    assert owner_area(settings, "alice") == settings.resolved_checkpoint_root / "alice"
