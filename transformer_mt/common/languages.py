"""Language codes: one table, read wherever tmt reads a language code (a config's src_lang and
tgt_lang, a glossary's language columns, a multi-target model's >>xxx<< tokens, tmt clean's
language identification and script rule).

Codes come in several forms for the same language: ISO 639-1 (de), ISO 639-3 / 639-2/T (deu, as
OPUS-MT's multilingual models and `tmt import` name them), ISO 639-2/B (ger), an individual
language of a macrolanguage (cmn for zh, arb for ar, nob for no), and any of these with a script
or region after "_" or "-" (sr_Latn, zh-Hant, pt_BR). `canonical` maps each to one key, the
639-1 code where there is one; `same_language` compares two codes by it. Unknown codes are not
guessed at: `canonical` returns None and the caller refuses them in one line.
"""

from __future__ import annotations

import re

# ISO 639-1, then its 639-3 (= 639-2/T) code, then the 639-2/B code where it differs.
_TABLE = """
aa aar|ab abk|ae ave|af afr|ak aka|am amh|an arg|ar ara|as asm|av ava|ay aym|az aze|ba bak|
be bel|bg bul|bh bih|bi bis|bm bam|bn ben|bo bod tib|br bre|bs bos|ca cat|ce che|ch cha|co cos|
cr cre|cs ces cze|cu chu|cv chv|cy cym wel|da dan|de deu ger|dv div|dz dzo|ee ewe|el ell gre|
en eng|eo epo|es spa|et est|eu eus baq|fa fas per|ff ful|fi fin|fj fij|fo fao|fr fra fre|
fy fry|ga gle|gd gla|gl glg|gn grn|gu guj|gv glv|ha hau|he heb|hi hin|ho hmo|hr hrv|ht hat|
hu hun|hy hye arm|hz her|ia ina|id ind|ie ile|ig ibo|ii iii|ik ipk|io ido|is isl ice|it ita|
iu iku|ja jpn|jv jav|ka kat geo|kg kon|ki kik|kj kua|kk kaz|kl kal|km khm|kn kan|ko kor|kr kau|
ks kas|ku kur|kv kom|kw cor|ky kir|la lat|lb ltz|lg lug|li lim|ln lin|lo lao|lt lit|lu lub|
lv lav|mg mlg|mh mah|mi mri mao|mk mkd mac|ml mal|mn mon|mr mar|ms msa may|mt mlt|my mya bur|
na nau|nb nob|nd nde|ne nep|ng ndo|nl nld dut|nn nno|no nor|nr nbl|nv nav|ny nya|oc oci|oj oji|
om orm|or ori|os oss|pa pan|pi pli|pl pol|ps pus|pt por|qu que|rm roh|rn run|ro ron rum|ru rus|
rw kin|sa san|sc srd|sd snd|se sme|sg sag|si sin|sk slk slo|sl slv|sm smo|sn sna|so som|
sq sqi alb|sr srp|ss ssw|st sot|su sun|sv swe|sw swa|ta tam|te tel|tg tgk|th tha|ti tir|tk tuk|
tl tgl|tn tsn|to ton|tr tur|ts tso|tt tat|tw twi|ty tah|ug uig|uk ukr|ur urd|uz uzb|ve ven|
vi vie|vo vol|wa wln|wo wol|xh xho|yi yid|yo yor|za zha|zh zho chi|zu zul
"""

# Individual languages that OPUS-MT and other corpora name where the 639-1 code is their
# macrolanguage's (or a close variant's): each is read as that language.
_MEMBERS = {
    "cmn": "zh", "yue": "zh", "wuu": "zh", "nan": "zh", "hak": "zh", "gan": "zh", "lzh": "zh",
    "arb": "ar", "arz": "ar", "apc": "ar", "ary": "ar", "acm": "ar", "ajp": "ar", "afb": "ar",
    "pes": "fa", "prs": "fa", "zsm": "ms", "zlm": "ms", "lvs": "lv", "ekk": "et", "als": "sq",
    "uzn": "uz", "azj": "az", "swh": "sw", "kmr": "ku", "ckb": "ku", "khk": "mn", "npi": "ne",
    "ory": "or", "plt": "mg", "quy": "qu", "quz": "qu", "gaz": "om", "pbt": "ps", "ydd": "yi",
    "hbs": "sh", "sh": "sh", "fil": "tl", "twi": "tw", "ltg": "lv",
}  # fmt: skip

_CANONICAL: dict[str, str] = {}
for _row in _TABLE.replace("\n", "").split("|"):
    _codes = _row.split()
    for _code in _codes:
        _CANONICAL[_code] = _codes[0]
_CANONICAL.update(_MEMBERS)

# Where tmt clean's script rule needs it: languages commonly written in more than one script.
SCRIPTS_OF = {
    "sr": ("Cyrillic", "Latin"), "sh": ("Latin", "Cyrillic"), "bs": ("Latin", "Cyrillic"),
    "az": ("Latin", "Cyrillic"), "uz": ("Latin", "Cyrillic"), "tk": ("Latin", "Cyrillic"),
    "mn": ("Cyrillic", "Mongolian"), "ku": ("Latin", "Arabic"), "pa": ("Gurmukhi", "Arabic"),
    "kk": ("Cyrillic", "Latin"), "tt": ("Cyrillic", "Latin"), "ms": ("Latin", "Arabic"),
}  # fmt: skip

_SPLIT = re.compile(r"[_\-]")


def canonical(code: str) -> str | None:
    """One key per language (its ISO 639-1 code where it has one; see the module docstring), a
    script or region part ("_Latn", "-BR") set aside; None for a code this table does not know."""
    base = _SPLIT.split(code.strip(), maxsplit=1)[0].lower()
    return _CANONICAL.get(base)


def script_part(code: str) -> str | None:
    """The ISO 15924 script a code names after its language (sr_Latn -> Latn), if any."""
    for part in _SPLIT.split(code.strip())[1:]:
        if len(part) == 4 and part.isalpha():
            return part.capitalize()
    return None


def same_language(a: str, b: str) -> bool:
    """Whether two codes name one language (de, deu, ger, de_DE, ...); unknown codes are the
    same only when they are spelled the same (case aside)."""
    known_a, known_b = canonical(a), canonical(b)
    if known_a is None or known_b is None:
        return a.strip().lower() == b.strip().lower()
    return known_a == known_b


def is_known(code: str) -> bool:
    return canonical(code) is not None


# Scripts written without spaces between words (Thai, Lao, Myanmar, Khmer, kana, Han), as
# character ranges for a regex class: glossaries take each character for a word, and scores warn
# where references in them would be read as a language with spaces.
UNSPACED = ("\u0e00-\u0eff\u1000-\u109f\u1780-\u17ff\u3040-\u30ff\u31f0-\u31ff\u3400-\u4dbf"
            "\u4e00-\u9fff\uf900-\ufaff\uff66-\uff9f\U00020000-\U0003134f")  # fmt: skip
_UNSPACED = re.compile(f"[{UNSPACED}]")
# The languages written in them (tmt clean measures their lengths in characters, not words).
NO_SPACES = frozenset(["zh", "ja", "th", "lo", "km", "my"])


def unspaced(character: str) -> bool:
    """Whether `character` is of a script written without spaces (a word of its own)."""
    return _UNSPACED.match(character) is not None


def any_unspaced(text: str) -> bool:
    """Whether `text` holds a character of a script written without spaces."""
    return _UNSPACED.search(text) is not None


def unspaced_share(text: str) -> float:
    """The share of `text`'s letters that are of scripts written without spaces (0 for none)."""
    letters = sum(map(str.isalpha, text))
    return len(_UNSPACED.findall(text)) / letters if letters else 0.0
