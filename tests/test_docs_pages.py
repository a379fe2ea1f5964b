"""The docs read as pages a reader finishes: each under its word budget, no paragraph on two pages
(where two pages need a fact, one states it and the other links to it)."""
import re
from collections import defaultdict

import pytest
from launch import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BUDGET = {"README.md": 1500}  # words, as `wc -w` counts them; every page of docs/: 2,000
SHORTEST = 12  # words: a shorter paragraph (a heading, "Also:", a table's header) may recur


def words(text: str) -> int:
    return len(text.split())


def paragraphs(text: str) -> list[str]:
    """The page's paragraphs outside code blocks, whitespace made single; a table or a list is one."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", prose) if words(p) >= SHORTEST]


def repeated(pages: dict[str, str]) -> dict[str, list[str]]:
    """Each paragraph found on two pages or more, with the pages."""
    where = defaultdict(set)
    for name, text in pages.items():
        for paragraph in paragraphs(text):
            where[paragraph].add(name)
    return {p: sorted(names) for p, names in where.items() if len(names) > 1}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_page_is_within_its_word_budget(page):
    budget = BUDGET.get(page.name, 2000)
    assert words(page.read_text()) <= budget, f"{page.name}: {words(page.read_text())} words, over {budget}"


def test_no_paragraph_is_on_two_pages():
    found = repeated({page.name: page.read_text() for page in PAGES})
    assert not found, "\n".join(f"{names}: {p[:120]}" for p, names in found.items())


def test_the_check_finds_a_paragraph_copied_to_another_page_and_nothing_in_code():
    fact = "A checkpoint written at pp 2 × fsdp 2 resumes at fsdp 4, at ddp and in one process, and theirs at pp."
    block = "```console\n$ python gpt/train.py --model tiny --out_dir out/one and more words than twelve here\n```"
    one, other = f"# One\n\n{fact}\n\n{block}\n", f"# Other\n\nIntro.\n\n{block}\n\n{fact.replace(' ', chr(10), 3)}\n"
    assert repeated({"one.md": one, "other.md": other}) == {fact: ["one.md", "other.md"]}
    assert repeated({"one.md": one, "other.md": f"# Other\n\n{block}\n"}) == {}
