"""Chinese search: the words jieba must keep whole when Material's search plugin segments the pages.

Material's search runs jieba over every page at build time and joins the words with U+200B (the separator in
``mkdocs.yml`` splits on it). jieba alone cuts some of the course's terms in two, and a search for the whole
term would then find nothing, so the terms below and the glossary's are added to its dictionary.
"""

from __future__ import annotations

import logging
import re

from .paths import ROOT

log = logging.getLogger("mkdocs.hooks.build_site")

# Chinese terms jieba must keep whole, so that searching for them finds them (jieba alone cuts 梯度分片 in two).
BASE_TERMS = [
    "梯度分片",
    "参数分片",
    "优化器状态分片",
    "分片",
    "卸载",
    "流水线",
    "暂存缓冲区",
    "暂存槽",
    "下行",
    "上行",
    "主权重",
    "模型状态",
    "优化器状态",
    "损失缩放",
    "混合精度",
    "延迟参数更新",
    "激活重计算",
    "模拟设备",
]


def glossary_terms() -> list[str]:
    """Chinese terms named in course/glossary.md: the tables' first cells and bold spans (CJK runs only)."""
    path = ROOT / "course" / "glossary.md"
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    found = []
    for line in text.splitlines():
        cells = (
            [c.strip() for c in line.strip().strip("|").split("|")] if line.lstrip().startswith("|") else []
        )
        chunks = cells[:1] + re.findall(r"\*\*([^*]+)\*\*", line)
        for chunk in chunks:
            found += re.findall(r"[\u4e00-\u9fff]{2,12}", chunk)
    return found


def search_terms() -> list[str]:
    """The terms for jieba's dictionary, longest first (recorded in the site map for the hooks)."""
    terms = list(BASE_TERMS) + glossary_terms()
    return sorted(set(terms), key=len, reverse=True)


def add_terms_to_jieba(terms: list[str]) -> None:
    try:
        import jieba

        jieba.setLogLevel(logging.WARNING)
        for term in terms:
            jieba.add_word(term, freq=200_000)
    except ImportError:
        log.warning("jieba is not installed: Chinese search will not segment words")
