"""The LibreTranslate API over a tmt model, so that its clients (browser extensions, Mastodon,
apps, scripts) work unchanged: POST /translate (q as text or a list, source as a language or
"auto", target, format text or html, alternatives, api_key; a JSON or a form body) answering
{"translatedText": ...}, GET or POST /languages and GET /frontend/settings (no key asked, as
LibreTranslate's server asks none there). Errors come in its shape, {"error": ...}, with its
words where it has them. The model serves one pair: another is a 400 naming it.

tmt's extension (LibreTranslate has no glossaries): `glossary` ([[source, target], ...] in a
JSON body, or TSV text in either) or `glossary_id` (a glossary stored with POST /v1/glossaries);
the answer then carries "terms" as /v1/translate's does. A request without them is answered
exactly as before.
"""

from __future__ import annotations

import html
import json
from html.parser import HTMLParser
from typing import Any

from fastapi import FastAPI, Request

from transformer_mt.serving.service import ServeError, Service, check_key, terms_of
from transformer_mt.translation.translate import Translator, detokenize

LANGUAGE_NAMES = {
    "ar": "Arabic", "cs": "Czech", "de": "German", "en": "English", "es": "Spanish",
    "fi": "Finnish", "fr": "French", "hi": "Hindi", "it": "Italian", "ja": "Japanese",
    "ko": "Korean", "nl": "Dutch", "pl": "Polish", "pt": "Portuguese", "ro": "Romanian",
    "ru": "Russian", "sv": "Swedish", "tr": "Turkish", "uk": "Ukrainian", "zh": "Chinese",
    # ISO 639-3, as multi-target OPUS-MT models name their targets (>>fra<<)
    "ara": "Arabic", "ces": "Czech", "deu": "German", "eng": "English", "spa": "Spanish",
    "fin": "Finnish", "fra": "French", "hin": "Hindi", "ita": "Italian", "jpn": "Japanese",
    "kor": "Korean", "nld": "Dutch", "pol": "Polish", "por": "Portuguese", "ron": "Romanian",
    "rus": "Russian", "swe": "Swedish", "tur": "Turkish", "ukr": "Ukrainian", "zho": "Chinese",
}  # fmt: skip


def add_endpoints(app: FastAPI, service: Service) -> None:
    data = service.translator.config.data

    # As LibreTranslate's server: GET or POST (its Python client sends a GET with a form body,
    # older ones a POST), no key asked (a key sent is ignored).
    @app.api_route("/languages", methods=["GET", "POST"])
    async def languages() -> list[dict[str, Any]]:
        targets = _targets(service.translator)
        return [
            {"code": data.src_lang, "name": _name(data.src_lang), "targets": targets},
            *({"code": code, "name": _name(code), "targets": []} for code in targets),
        ]

    @app.get("/frontend/settings")  # what LibreTranslate's page and clients ask first
    async def settings() -> dict[str, Any]:
        source, target = data.src_lang, _targets(service.translator)[0]
        return {
            "charLimit": service.cfg.max_chars, "frontendTimeout": 500,
            "apiKeys": bool(service.api_key), "keyRequired": bool(service.api_key),
            "suggestions": False, "filesTranslation": False, "supportedFilesFormat": [],
            "language": {"source": {"code": source, "name": _name(source)},
                         "target": {"code": target, "name": _name(target)}},
        }  # fmt: skip

    @app.post("/translate")
    async def translate(request: Request) -> dict[str, Any]:
        fields = await _fields(request)
        # api_key in the JSON or form body, or in the query string (LibreTranslate's
        # request.values), or tmt's Authorization: Bearer.
        given = fields.get("api_key") or request.query_params.get("api_key")
        check_key(request.headers.get("authorization", ""), service.api_key, given)
        return await _translate(service, request, fields)


_LT_FIELDS = {"q", "source", "target", "format", "api_key", "alternatives", "secret",
              "glossary", "glossary_id"}  # fmt: skip


async def _fields(request: Request) -> dict[str, Any]:
    """A LibreTranslate request's fields, from a JSON or a form body."""
    if request.headers.get("content-type", "").split(";")[0].strip() == "application/json":
        try:
            fields = json.loads(await request.body())
        except (ValueError, RecursionError):
            raise ServeError(400, "Invalid request: the body is not valid JSON") from None
        if not isinstance(fields, dict):
            raise ServeError(400, "Invalid request: the body is not a JSON object")
    else:
        form = await request.form()
        fields = {key: form.getlist(key) if key == "q" else form.get(key) for key in form}
        if isinstance(fields.get("q"), list) and len(fields["q"]) == 1:
            fields["q"] = fields["q"][0]
    unknown = sorted(set(fields) - _LT_FIELDS)
    if unknown:
        raise ServeError(400, f"Invalid request: unknown parameter {unknown[0]}")
    return fields


async def _translate(service: Service, request: Request, fields: dict[str, Any]) -> Any:
    data = service.translator.config.data
    for name in ("q", "source", "target"):
        if fields.get(name) in (None, "", []):
            raise ServeError(400, f"Invalid request: missing {name} parameter")
    q, source, target = fields["q"], fields["source"], fields["target"]
    batch = isinstance(q, list)
    lines = q if batch else [q]
    if not all(isinstance(x, str) for x in lines) or not all(
        isinstance(fields.get(k, ""), str) for k in ("source", "target", "format")
    ):
        raise ServeError(400, "Invalid request: q, source, target and format are text")
    _check_pair(service.translator, source, target)
    text_format = fields.get("format") or "text"
    if text_format not in ("text", "html"):
        raise ServeError(400, f"{text_format} format is not supported")
    alternatives = fields.get("alternatives") or 0
    if isinstance(alternatives, str) and alternatives.isdigit():
        alternatives = int(alternatives)
    if not isinstance(alternatives, int) or isinstance(alternatives, bool) or alternatives < 0:
        raise ServeError(400, "Invalid request: alternatives is a number >= 0")
    decode = service.translator.config.decode
    # A multi-target model: the target is its language token (>>xxx<<), put first.
    overrides = (
        [] if target == data.tgt_lang else [(f"decode.target_lang={target}", f"target={target}")]
    )
    if alternatives:
        beam, typed = max(decode.beam_size, alternatives + 1), f"alternatives={alternatives}"
        overrides += [
            (f"decode.beam_size={beam}", typed),
            (f"decode.nbest={alternatives + 1}", typed),
        ]
    chosen = service.translator_for(overrides)
    glossary = service.glossary_for(fields.get("glossary"), fields.get("glossary_id"))
    terms = None
    if text_format == "html":
        if glossary is not None:
            raise ServeError(400, "glossary: with format text only")
        texts = await _translate_html(service, request, chosen, lines)
        options: list[list[str]] = [[] for _ in lines]
    else:
        hyps = await service.translate(request, lines, chosen, glossary=glossary)
        outputs = [detokenize(chosen, [h.tokens for h in line]) if line else [""] for line in hyps]
        texts = [out[0] for out in outputs]
        options = [out[1:] for out in outputs]
        terms = terms_of(lines, service.matches_of(lines, chosen, glossary), hyps)
    answer: dict[str, Any] = {"translatedText": texts if batch else texts[0]}
    if terms is not None:
        answer["terms"] = terms if batch else terms[0]
    if alternatives:
        answer["alternatives"] = options if batch else options[0]
    if source == "auto":  # one source language: the model's (no detection)
        detected = {"confidence": 100.0, "language": data.src_lang}
        answer["detectedLanguage"] = [detected] * len(lines) if batch else detected
    return answer


def _check_pair(translator: Translator, source: str, target: str) -> None:
    """Refuse, in LibreTranslate's words, a pair the model does not translate."""
    data, targets = translator.config.data, _targets(translator)
    known = (data.src_lang, data.tgt_lang, *targets)
    for code in (source if source != "auto" else data.src_lang, target):
        if code not in known:
            raise ServeError(400, f"{code} is not supported")
    source_code = data.src_lang if source == "auto" else source
    if source_code != data.src_lang or target not in targets:
        raise ServeError(400, f"{_name(target)} ({target}) is not available as a target language"
                              f" from {_name(source_code)} ({source_code})")  # fmt: skip


class _Segments(HTMLParser):
    """HTML split into markup (kept as written) and text (translated)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[tuple[bool, str]] = []  # (is_text, content)

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        self.parts.append((False, self.get_starttag_text() or ""))

    def handle_startendtag(self, tag: str, attrs: Any) -> None:
        self.parts.append((False, self.get_starttag_text() or ""))

    def handle_endtag(self, tag: str) -> None:
        self.parts.append((False, f"</{tag}>"))

    def handle_data(self, data: str) -> None:
        self.parts.append((True, data))

    def handle_comment(self, data: str) -> None:
        self.parts.append((False, f"<!--{data}-->"))

    def handle_decl(self, decl: str) -> None:
        self.parts.append((False, f"<!{decl}>"))


async def _translate_html(
    service: Service, request: Request, translator: Translator, documents: list[str]
) -> list[str]:
    """format html: the text between tags translated, the tags kept, whitespace kept around.
    The texts of all documents are one request to the service (its limits count them all)."""
    parsed = []
    for markup in documents:
        parser = _Segments()
        parser.feed(markup)
        parser.close()
        parsed.append(parser.parts)
    texts = [c.strip() for parts in parsed for is_text, c in parts if is_text and c.strip()]
    hyps = await service.translate(request, texts, translator) if texts else []
    translated = iter(detokenize(translator, [h[0].tokens if h else [] for h in hyps]))
    out = []
    for parts in parsed:
        pieces = []
        for is_text, content in parts:
            if is_text and content.strip():
                lead = content[: len(content) - len(content.lstrip())]
                trail = content[len(content.rstrip()) :]
                pieces.append(lead + html.escape(next(translated), quote=False) + trail)
            else:
                pieces.append(html.escape(content, quote=False) if is_text else content)
        out.append("".join(pieces))
    return out


def _targets(translator: Translator) -> list[str]:
    """The languages the model translates into: a multi-target model's language tokens (>>fra<<
    is fra), else its one target language."""
    codes = [code[2:-2] for code in translator.tokenizer.language_codes]
    return codes or [translator.config.data.tgt_lang]


def _name(code: str) -> str:
    return LANGUAGE_NAMES.get(code, code)
