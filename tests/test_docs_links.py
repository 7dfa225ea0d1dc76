"""Every page in docs/ and results/ is reachable: each docs/*.md and results/*.md is the target of a Markdown
link from README.md or from another such page (14 generated sweep and routing tables were linked from nowhere),
so a new page cannot be left an orphan."""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md")) + sorted((REPO / "results").glob("*.md"))


def linked_pages():
    """{page: the pages that link to it}, from [text](path) links outside code blocks (a page linking to
    itself does not count)."""
    found = {}
    for page in [README, *DOCS]:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s#]+)[^)\s]*\)", text):
            if re.match(r"\w+://|mailto:", target):
                continue
            dest = (page.parent / target).resolve()
            if dest != page:
                found.setdefault(dest, set()).add(page.name)
    return found


def test_every_docs_page_is_linked_from_the_readme_or_another_page():
    linked = linked_pages()
    orphans = [p.name for p in DOCS if p.resolve() not in linked]
    assert not orphans, f"docs pages no page links to (link each from the page that discusses it): {orphans}"
    assert len(DOCS) > 20
