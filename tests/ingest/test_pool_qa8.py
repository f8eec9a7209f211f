"""What the pool sends and stores of a prompt: its lines as written, less only what no reader sees."""

from eaglenest.config import build
from eaglenest.ingest.manifest import Manifest
from eaglenest.ingest.pool import build_pool
from eaglenest.text import content_key

CODE = "    for i in range(3):\n        print(i)\nWhat does this print?"


def _pool(prompt: str):
    m = build(Manifest, {"name": "t", "licence": "x", "held_out_fraction": 0.0, "raw_fraction": 0.0,
                         "domains": {"a": {"cap_prompts": 10, "sources": [{"path": "x", "provenance": "p"}]}}})
    (entry,) = build_pool(m, {"a": [{"prompt": prompt, "system": "", "source": "s"}]})
    return entry


def test_an_indented_first_line_keeps_its_indentation():
    # Tidying stripped the whole text, so the first line of an indented snippet lost its indentation while
    # the lines after it kept theirs: the target was asked about code that no longer parses.
    entry = _pool(CODE)
    assert entry.prompt == CODE
    assert entry.sample_id == f"a-{content_key(CODE)[:16]}"  # the identity is whitespace-insensitive: ids unchanged


def test_indentation_common_to_every_line_and_blank_lines_around_go():
    entry = _pool("\n  \n  def f():\n      return 1  \n\n")
    assert entry.prompt == "def f():\n    return 1"
    assert entry.sample_id == f"a-{content_key('def f(): return 1')[:16]}"


def test_every_newline_convention_is_sent_as_one():
    # "\r\n" (Windows) and a lone "\r" (classic Mac, some exports) are both line breaks: stored as "\n".
    for sep in ("\r\n", "\r", "\n"):
        assert _pool(f"line one{sep}line two{sep}").prompt == "line one\nline two"
