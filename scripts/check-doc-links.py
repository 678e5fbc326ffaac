#!/usr/bin/env python3
"""Fails on a dead link in generated rustdoc HTML.

Usage: check-doc-links.py DOC_DIR [CRATE...]

Checks every relative link to a page (`*.html`) of the HTML pages under
DOC_DIR/CRATE (every crate directory when none is named): the file it
points at must exist. Rustdoc's `-D warnings` catches broken intra-doc links, but not a
link into a crate that was not documented (`cargo doc --no-deps -p verbio`
documents the facade alone): that is what this finds.
"""
import html
import os
import re
import sys

HREF = re.compile(r'(?:href|src)="([^"]*)"')


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    root = os.path.abspath(sys.argv[1])
    crates = sys.argv[2:] or [
        d for d in os.listdir(root)
        if os.path.isfile(os.path.join(root, d, "index.html"))
    ]
    dead = {}
    pages = 0
    for crate in crates:
        top = os.path.join(root, crate)
        if not os.path.isdir(top):
            print(f"{top}: not generated", file=sys.stderr)
            return 1
        for dirpath, _, files in os.walk(top):
            for name in files:
                if not name.endswith(".html"):
                    continue
                page = os.path.join(dirpath, name)
                pages += 1
                with open(page, encoding="utf-8") as f:
                    text = f.read()
                for link in HREF.findall(text):
                    link = html.unescape(link)
                    if re.match(r"^[a-z]+:", link) or link.startswith(("#", "/")) or "${" in link:
                        continue
                    target = link.split("#", 1)[0].split("?", 1)[0]
                    # Rustdoc's own links end in .html. Other hrefs come from
                    # the docs of foreign traits' blanket impls (tracing's
                    # `Instrument`, say), relative to a page not generated
                    # here: not ours to fix.
                    if not target.endswith(".html"):
                        continue
                    path = os.path.normpath(os.path.join(dirpath, target))
                    if not os.path.exists(path):
                        dead.setdefault(os.path.relpath(path, root), set()).add(
                            os.path.relpath(page, root))
    for target, from_pages in sorted(dead.items()):
        some = sorted(from_pages)
        more = f" and {len(some) - 3} more" if len(some) > 3 else ""
        print(f"dead link to {target} from {', '.join(some[:3])}{more}")
    print(f"{pages} pages checked, {len(dead)} dead link targets")
    return 1 if dead else 0


if __name__ == "__main__":
    sys.exit(main())
