"""What "the secret" is (ett/protocol/redaction.py): its characters in order, with NULs and bytes
that are no UTF-8 between them ignored, as whoever reads the output ignores them; blanked so in a
stream read piece by piece, in stored text, and in every string of an event's data."""

import random

import pytest

from ett.protocol.redaction import REDACTED, Redactor, Secrets, redact

SECRETS = ["alpha-s3cr3t-A1", "bravo-s3cr3t-B2", "clé-sécrète-C3"]
# As a rank may print them: an invalid byte inside, a NUL inside, a character's bytes apart by a NUL.
PRINTED = (b"A alpha-\xffs3cr3t-A1\nB bravo-\x00s3cr3t-B2\nC cl\xc3\xa9-s\x00\xc3\xa9cr\xc3\xa8te-C3\n"
           b"not one: alpha-s3cr3t and a lone \xff byte\n")  # fmt: skip
BLANKED = b"A [redacted]\nB [redacted]\nC [redacted]\nnot one: alpha-s3cr3t and a lone \xff byte\n"


@pytest.mark.parametrize("seed", range(10))
def test_a_secret_with_an_invalid_byte_or_a_nul_inside_is_blanked_however_the_reads_cut_it(seed):
    cuts = sorted(random.Random(seed).sample(range(1, len(PRINTED)), 15))
    redactor = Redactor(SECRETS)
    out = b"".join(redactor.feed(PRINTED[a:b]) for a, b in zip([0, *cuts], [*cuts, len(PRINTED)], strict=True))
    assert out + redactor.flush() == BLANKED  # every other byte as it was, the stray \xff too


def test_the_service_blanks_the_same_in_text_the_node_decoded():
    # The log shipper decodes with errors="replace": the invalid byte is U+FFFD there.
    assert redact(PRINTED.decode(errors="replace"), SECRETS) == BLANKED.decode(errors="replace")


def test_every_secret_of_an_events_data_is_blanked_at_any_depth_but_a_path_the_service_resumes_from():
    deep: list = ["golfo-s3cr3t-G7 at the bottom"]
    for _ in range(5000):  # deeper than Python recurses
        deep = [deep]
    data = {"duration": 0.5, "note": "key golfo-\x00s3cr3t-G7", "golfo-s3cr3t-G7": 1,
            "nested": {"list": [1, "x golfo-\ufffds3cr3t-G7 y"]}, "deep": deep, "path": "/ckpt/golfo-s3cr3t-G7"}
    secrets = Secrets(["golfo-s3cr3t-G7", "gpu"])
    secrets.blank_data("step", data)
    assert data["note"] == f"key {REDACTED}" and data["nested"]["list"] == [1, f"x {REDACTED} y"]
    bottom = data["deep"]
    while isinstance(bottom[0], list):
        bottom = bottom[0]
    assert bottom == [f"{REDACTED} at the bottom"]
    assert data["path"] == f"/ckpt/{REDACTED}"
    assert "golfo-s3cr3t-G7" not in data and data[REDACTED] == 1  # a name no field of the kind has: blanked
    numbers = {"duration": 48151623.0, "note": {"id": 48151623, "48151623": [48151623]}, "ok": 7}
    assert Secrets(["48151623"]).blank_data("step", numbers) == {  # a declared field that is the secret: dropped
        "note": {"id": REDACTED, REDACTED: [REDACTED]}, "ok": 7}
    commit = {"path": "/ckpt/golfo-s3cr3t-G7/step-5", "note": "golfo-s3cr3t-G7"}
    assert secrets.blank_data("ckpt_committed", commit) == {"path": "/ckpt/golfo-s3cr3t-G7/step-5", "note": REDACTED}


def test_what_is_kept_back_is_bounded_whatever_a_rank_writes_inside_a_secret():
    redactor = Redactor(["alpha-s3cr3t-A1"])
    out = redactor.feed(b"alpha-")
    for _ in range(100):
        out += redactor.feed(b"\0" * 65536)  # 6.5 MB of NULs after a secret's start
        assert redactor.held <= len("alpha-s3cr3t-A1") + Redactor.HOLD_MAX_CHARS
    assert out.startswith(b"alpha-")


def test_a_declared_number_that_is_a_secret_is_dropped_and_one_holding_its_digits_among_others_kept():
    secrets = Secrets(["48151623", "2024"])
    data = {"duration": 0.5, "tokens": 48151623, "loss": 48151623.0, "note": {"n": 2024}}
    assert secrets.blank_data("step", data) == {"duration": 0.5, "note": {"n": REDACTED}}
    # A count of 120,245 tokens holds a secret of 4 digits, and stays: the accounting's figure.
    kept = {"duration": 12024.5, "tokens": 120245}
    assert secrets.blank_data("step", dict(kept)) == kept
    assert secrets.blank_data("step", {"duration": 2024}) == {}  # no step: the service refuses it
