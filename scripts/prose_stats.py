#!/usr/bin/env python3
"""How long the sentences of the docs are: README.md and docs/*.md, prose only.

    python3 scripts/prose_stats.py            (README.md and docs/*.md)
    python3 scripts/prose_stats.py docs/x.md  (just those files)

Prints, per file and over all of them: the number of sentences, the median words a sentence,
the share of sentences over 40 words, and the longest sentence (its file, length and first
words). The docs aim at a median of at most 18, at most 5% over 40 and none over 70.

What counts as prose:
- Left out: front matter (a `---` block at the top), fenced code blocks (``` or ~~~),
  headings (lines starting with `#`), table rows (lines starting with `|`), HTML comments
  and image lines.
- Kept: paragraphs and list items. A list item is a unit of its own: it never runs into the
  sentence before or after it, and an item without a full stop still counts as a sentence.

How a unit is split into sentences:
- Lines of one paragraph (or one list item and its indented continuation) are joined first.
- Inline code spans and link targets are made single words first, so a dot inside
  `docs/api.md` or a URL never ends a sentence. A link counts as its text.
- A sentence ends at `.`, `!` or `?` (after any closing quote, bracket or `*`) followed by a
  space and a character that is not a lower-case letter. So "e.g. a key" does not split, and
  "90 s. The key" does.
- A colon or a semicolon does not end a sentence: a chain of clauses joined by semicolons
  counts as one long sentence, which is the point.

A word is a whitespace-separated token with at least one letter or digit in it.
"""

import glob
import os
import re
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LONG = 40
LIST_ITEM = re.compile(r"^\s*([-*+]|\d+[.)])\s+")
CODE_SPAN = re.compile(r"`[^`]*`")
LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]*]*\s+(?=[^a-z\s])")


def units(text):
    """The paragraphs and list items of a Markdown text, each as one line of prose."""
    lines = text.splitlines()
    if lines and lines[0].strip() == "---":
        end = next((i for i in range(1, len(lines)) if lines[i].strip() == "---"), None)
        if end is not None:
            lines = lines[end + 1 :]
    out, current, fence, comment = [], [], None, False

    def flush():
        if current:
            out.append(" ".join(current))
            current.clear()

    for line in lines:
        stripped = line.strip()
        if fence:
            if stripped.startswith(fence):
                fence = None
            continue
        if stripped.startswith("```") or stripped.startswith("~~~"):
            flush()
            fence = stripped[:3]
            continue
        if comment:
            comment = "-->" not in stripped
            continue
        if stripped.startswith("<!--"):
            flush()
            comment = "-->" not in stripped
            continue
        if not stripped or stripped.startswith(("#", "|", "![")):
            flush()
            continue
        if LIST_ITEM.match(line):
            flush()
            current.append(LIST_ITEM.sub("", line, count=1).strip())
            continue
        current.append(stripped.lstrip("> ").strip())
    flush()
    return out


def words(sentence):
    return [w for w in sentence.split() if re.search(r"[A-Za-z0-9]", w)]


def sentences(unit):
    """The sentences of one unit, each with its words counted on the original text."""
    spans = []

    def keep(m):
        spans.append(m.group(0))
        return f"\x00{len(spans) - 1}\x00"

    masked = CODE_SPAN.sub(keep, unit)
    masked = LINK.sub(lambda m: m.group(1), masked)
    restore = lambda s: re.sub(r"\x00(\d+)\x00", lambda m: spans[int(m.group(1))], s)
    return [restore(s).strip() for s in SENTENCE_END.split(masked) if words(s)]


def measure(path):
    with open(path, encoding="utf-8") as f:
        return [(len(words(s)), s) for u in units(f.read()) for s in sentences(u)]


def summary(name, found):
    if not found:
        return f"{name}: no prose"
    counts = [n for n, _, _ in found]
    longest = max(found, key=lambda x: x[0])
    over = sum(1 for n in counts if n > LONG)
    first = " ".join(longest[2].split()[:8])
    return (
        f"{name}: {len(counts)} sentences, median {statistics.median(counts):g} words, "
        f"{100 * over / len(counts):.0f}% over {LONG} ({over}), "
        f"longest {longest[0]} ({longest[1]}: \"{first} ...\")"
    )


def main(paths):
    if not paths:
        paths = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    everything = []
    for path in paths:
        rel = os.path.relpath(path, ROOT)
        found = [(n, rel, s) for n, s in measure(path)]
        everything += found
        print(summary(rel, found))
    if len(paths) > 1:
        print(summary("overall", everything))


if __name__ == "__main__":
    main(sys.argv[1:])
