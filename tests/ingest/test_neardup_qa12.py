"""Near duplicates in scripts written without spaces between words (Chinese, Japanese, Thai) and in scripts
whose words hold combining marks (Devanagari): shingles of what a reader would call words, not of a whole
sentence or of fragments cut at every vowel sign. Pure CPU, no engine."""

from __future__ import annotations

from eaglenest.config import build
from eaglenest.ingest.contamination import NearIndex
from eaglenest.ingest.manifest import Manifest
from eaglenest.ingest.neardup import NearDupIndex, jaccard, shingles
from eaglenest.ingest.pool import build_pool

#: Real-ish prompts, each with a near twin (one word changed, punctuation added) and an unrelated prompt
#: of the same script.
CASES = {
    "chinese": ("请帮我写一首关于春天的短诗，要求押韵，每句七个字，并解释其中使用的修辞手法。",
                "请帮我写一首关于秋天的短诗，要求押韵，每句七个字，并解释其中使用的修辞手法。",
                "如何用Python读取一个很大的CSV文件而不占用太多内存？请给出示例代码。"),
    "japanese": ("東京から大阪まで新幹線で行く場合、所要時間と料金はどれくらいですか？おすすめの時間帯も教えてください。",
                 "東京から京都まで新幹線で行く場合、所要時間と料金はどれくらいですか？おすすめの時間帯も教えてください。",
                 "日本語の敬語の使い方について、尊敬語と謙譲語の違いを例文を使って説明してください。"),
    "thai": ("ช่วยอธิบายวิธีการทำต้มยำกุ้งแบบดั้งเดิมให้หน่อย พร้อมบอกวัตถุดิบที่ต้องใช้ทั้งหมดและขั้นตอนอย่างละเอียด",
             "ช่วยอธิบายวิธีการทำต้มยำไก่แบบดั้งเดิมให้หน่อย พร้อมบอกวัตถุดิบที่ต้องใช้ทั้งหมดและขั้นตอนอย่างละเอียด",
             "ประเทศไทยมีจังหวัดทั้งหมดกี่จังหวัด และจังหวัดใดมีพื้นที่ใหญ่ที่สุดในประเทศ"),
    "hindi": ("कृपया मुझे बताइए कि भारत में मानसून का मौसम कब शुरू होता है और यह खेती के लिए इतना ज़रूरी क्यों है।",
              "कृपया मुझे बताइए कि भारत में मानसून का मौसम कब शुरू होता है और यह किसानों के लिए इतना ज़रूरी क्यों है।",
              "दिल्ली से आगरा तक ट्रेन से जाने में कितना समय लगता है और टिकट कहाँ से खरीदें?"),
}


def test_near_twins_are_found_and_unrelated_prompts_are_not_in_unspaced_scripts():
    # A Chinese or Japanese prompt was one or two "words" (\w+ runs up to the punctuation), so it had one
    # shingle, the whole prompt: a twin with one character changed shared nothing (Jaccard 0) and was never
    # found. Thai words were cut at every vowel sign into fragments a syllable long, shared by unrelated text.
    for script, (text, twin, other) in CASES.items():
        a, b, c = shingles(text), shingles(twin), shingles(other)
        assert len(a) > 10, (script, a)
        assert jaccard(a, b) >= 0.5, (script, jaccard(a, b))
        assert jaccard(a, c) < 0.05, (script, jaccard(a, c))
        idx = NearDupIndex(0.5)
        idx.add("text", idx.sketch(text))
        assert idx.find(idx.sketch(twin)) == "text", script
        assert idx.find(idx.sketch(other)) is None, script


def test_the_pool_drops_the_near_twin_of_a_chinese_prompt():
    manifest = build(Manifest, {"name": "t", "licence": "x", "held_out_fraction": 0.0, "raw_fraction": 0.0,
                                "dedup": {"near_duplicate_threshold": 0.5},
                                "domains": {"zh": {"cap_prompts": 10, "sources": [{"path": "x", "provenance": "p"}]}}})
    report: dict = {}
    pool = build_pool(manifest, {"zh": [{"prompt": t, "system": "", "source": "s"} for t in CASES["chinese"]]},
                      report=report)
    assert report["domains"]["zh"]["near_duplicates"] == 1 and len(pool) == 2
    assert CASES["chinese"][2] in {e.prompt for e in pool}


def test_words_keep_their_combining_marks():
    # Devanagari vowel signs and viramas, Thai vowels and tone marks are marks, not word characters to \w:
    # "नमस्ते" was read as the two words "नमस" and "त".
    assert shingles("नमस्ते", 1) == frozenset({"नमस्ते"})
    assert shingles("ที่", 1) == frozenset({"ที่"})  # one letter with its vowel and tone mark
    assert shingles("Hello, world!", 1) == frozenset({"hello", "world"})
    # a Latin word written with a combining accent NFKC cannot fold keeps it too
    assert shingles("q\u0301uick fox", 1) == frozenset({"q\u0301uick", "fox"})


def test_a_mixed_prompt_splits_into_latin_words_and_han_characters():
    assert shingles("用Python写快速排序", 1) == frozenset({"用", "python", "写", "快", "速", "排", "序"})


def test_contamination_finds_a_near_twin_of_a_chinese_eval_prompt():
    text, twin, other = CASES["chinese"]
    index = NearIndex([text])
    assert index.best(twin) >= 0.6
    assert index.best(other) < 0.05


def test_invisible_characters_split_no_word():
    # Identity leaves out the characters that show nothing (eaglenest.text.INVISIBLE: a soft hyphen from a web
    # page, a zero-width space), so two spellings are one prompt; shingles cut the word at them, so whether a
    # near twin of an evaluation prompt was dropped depended on which spelling the source listed first.
    base = "What is the capital city of France and why is it famous for its art and its food"
    twin = base.replace("famous", "well known")
    for hidden in ("capi\u00adtal", "capi\u200btal", "\u2060capital"):
        assert shingles(twin.replace("capital", hidden)) == shingles(twin)
    index = NearIndex([base])
    assert index.best(twin.replace("capital", "capi\u00adtal")) == index.best(twin) > 0.4
