#!/usr/bin/python3
"""Write the tokenizer test strings, one JSON string per line, to the file named by argv[1].

Hand-written edge cases first, then seeded random mixes of scripts, then one ~5 KB document.
Deterministic: the same file every run.
"""

import json
import random
import sys

HAND = [
    "",
    " ",
    "  ",
    "\n",
    "\t",
    "a",
    "Hello world",
    "Hello, world!",
    " Hello world",
    "Hello  world   ",
    "   leading and trailing   ",
    "multiple     spaces\tand\ttabs\t\tdouble",
    "line one\nline two\n\nline four\n\n\n",
    "windows\r\nline\r\nendings\r\n\r\n",
    "mixed \r \n \r\n\t \u000b \u000c end",
    "trailing newline spaces  \n  \n",
    "nbsp\u00a0here and\u00a0\u00a0two, ideographic\u3000space, nel\u0085char",
    "em\u2003space thin\u2009space zero\u200bwidth narrow\u202fnb",
    "1234567890",
    "12345678901234567890123456789",
    "3.14159 2,718 1e-10 -42 +7 0x1F 0b1010 1_000_000",
    "Phone: +1 (555) 123-4567, ZIP 90210, year 2024.",
    "I'm you're he's she'd we'll they've it's can't won't",
    "I'M YOU'RE HE'S SHE'D WE'LL THEY'VE IT'S CAN'T",
    "rock 'n' roll, 'quoted', ''double'', 'tis",
    "don\u2019t curly \u201cquotes\u201d and \u2018single\u2019",
    "def foo(x):\n    return x * 2  # comment\n",
    "int main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}\n",
    "if (a && b || !c) { x += y >> 2; } else if (p->q != NULL) {}",
    "{\"key\": [1, 2, 3], \"nested\": {\"a\": null, \"b\": true}}",
    "<html><body class=\"main\"><p>Hi &amp; bye</p></body></html>",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
    "https://example.com/path/to/page?query=1&lang=en#section-2",
    "Visit http://www.test.org or ftp://files.example.net/pub/x.tar.gz now",
    "mail me: first.last+tag@sub.example.co.uk",
    "C:\\Users\\name\\Documents\\file.txt",
    "~/.config/moed/moed.conf:12: bad key 'foo'",
    "$ ls -la | grep '\\.c$' | wc -l",
    "snake_case camelCase PascalCase kebab-case SCREAMING_CASE",
    "!!!???...,,,;;;:::---___===+++***&&&%%%$$$###@@@",
    "(((nested [brackets {and} more])))",
    "\U0001F600\U0001F603\U0001F604 emoji run",
    "family \U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466 zwj",
    "flag \U0001F3F3\ufe0f\u200d\U0001F308 and \U0001F1FA\U0001F1F8 \U0001F1EF\U0001F1F5",
    "skin \U0001F44D\U0001F3FD \U0001F44B\U0001F3FF tones",
    "\u2764\ufe0f \u263a\ufe0f \u2600 text-vs-emoji",
    "\u4f60\u597d\uff0c\u4e16\u754c\uff01\u4eca\u5929\u5929\u6c14\u5f88\u597d\u3002",
    "\u6211\u4eec\u57282024\u5e74\u5f00\u53d1\u4e86\u65b0\u7684\u6a21\u578bQwen3-MoE\u3002",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3067\u3059\u3002\u30ab\u30bf\u30ab\u30ca\u3082\u3002",
    "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8\uc785\ub2c8\ub2e4. \uc548\ub155\ud558\uc138\uc694!",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645! \u0647\u0630\u0627 \u0646\u0635 \u0639\u0631\u0628\u064a.",
    "\u0627\u0644\u0639\u064e\u0631\u064e\u0628\u0650\u064a\u0651\u064e\u0629\u064f \u0645\u064e\u0639\u064e \u0627\u0644\u062a\u0651\u064e\u0634\u0652\u0643\u0650\u064a\u0644",
    "\u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd",
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e! \u092f\u0939 \u0939\u093f\u0902\u0926\u0940 \u0939\u0948\u0964",
    "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35\u0e04\u0e23\u0e31\u0e1a \u0e20\u0e32\u0e29\u0e32\u0e44\u0e17\u0e22",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440! \u0401\u043b\u043a\u0430 \u0438 \u0451\u0436.",
    "\u0393\u03b5\u03b9\u03ac \u03c3\u03bf\u03c5 \u039a\u03cc\u03c3\u03bc\u03b5",
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00c5ngstr\u00f6m (NFC)",
    "cafe\u0301 nai\u0308ve re\u0301sume\u0301 A\u030angstro\u0308m (NFD)",
    "\u1e9b\u0323 \u212b \u2126 \ufb01 \u00bd \u2460 (compat chars)",
    "e\u0301\u0302\u0303\u0304 stacked combining marks",
    "\u0069\u0307 \u0130 \u0131 \u00df \u1e9e Turkish and German",
    "Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334\u0319\u0324\u031e\u0349\u035a\u032f\u031e\u0320\u034dA\u036b\u0357\u0334\u0362\u0335\u031c\u0330\u0354L\u0368\u0367\u0369\u0358\u0320G\u0311\u0357\u030e\u0305\u035b\u0341\u0334\u033b\u0348\u034d\u0354\u0339O zalgo",
    "math: \u2200x\u2208\u211d, \u2203y: x\u00b2 + y\u00b2 \u2264 1 \u21d2 \u222b f(x) dx \u2248 \u03c0",
    "currency \u20ac100 \u00a350 \u00a5200 \u20b9300 \u20bf0.5",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>",
    "<|im_start",
    "<|im_start|",
    "|im_start|>",
    "<| im_start |>",
    "<<|im_start|>>",
    "<s>",
    "<s> Hello</s>",
    "a<s>b</s>c",
    "<s><s></s>",
    "</s>",
    "<unk>",
    "<think>\nreasoning here\n</think>\n\nAnswer.",
    "<think>",
    "<thinking>",
    "<tool_call>{\"name\": \"f\"}</tool_call>",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
    "<|begin_of_text",
    "<|eot_id|><|eot_id|>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<\uff5cbegin\u2581of\u2581sentence\uff5c>Hi<\uff5cUser\uff5c>q<\uff5cAssistant\uff5c>",
    "<\uff5cUser\uff5c>",
    "<|User|>",
    "[INST] What is 2+2? [/INST]",
    "\u2581leading block char \u2581\u2581 twice",
    "<0x41> <0xFF> literal byte names",
    "tab\tseparated\tvalues\t1\t2\t3",
    "a\n\nb\n\n\nc\n\n\n\nd",
    " \n \n ",
    "\n\n\n\n\n\n\n\n\n\n",
    "                                        ",
    "\t\t\t\t\t\t\t\t",
    "x" * 300,
    "ab" * 150,
    "9" * 100,
    "\u4e2d" * 120,
    "!" * 64,
    "aaaa bbbb cccc dddd eeee ffff gggg",
    "The quick brown fox jumps over the lazy dog.",
    "THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG!",
    "Supercalifragilisticexpialidocious antidisestablishmentarianism",
    "pneumonoultramicroscopicsilicovolcanoconiosis",
    "Mixed\u4e2d\u6587English\u65e5\u672c\u8a9e123\u0639\u0631\u0628\u064a",
    "ABC\u4e00\u9fa5\u3040\u30ffxyz boundaries of DeepSeek's CJK class",
    "\u3041\u3042\u30a1\u30a2\u30fc\u309d\u309e hiragana/katakana",
    "\u00a9 2024 Company\u2122. All rights reserved\u00ae.",
    "bullet \u2022 item \u2013 dash \u2014 em-dash \u2026 ellipsis",
    "\u00bfQu\u00e9? \u00a1S\u00ed! Espa\u00f1ol \u00e7a va? \u00c0 bient\u00f4t",
    "Ce\u0219ti \u021bar\u0103 \u0142\u00f3d\u017a \u017e\u00e1k \u0151r",
    "1st 2nd 3rd 4th 21st 100th",
    "v1.2.3-beta+build.456",
    "2024-01-15T10:30:00Z 10:30:00.123",
    "#hashtag @mention $TICKER %percent ^caret",
    "**bold** _italic_ `code` ~~strike~~ [link](http://x.y)",
    "| col1 | col2 |\n|------|------|\n| a    | b    |",
    "    indented code\n        more indent\n",
    "\"\"\"docstring\"\"\" '''single'''",
    "a.b.c.d e,f,g h;i;j",
    "...and then...",
    "hello\u200dworld zwj between letters",
    "\ufeffBOM at start",
    "soft\u00adhyphen",
    "\u00a0\u00a0\u00a0",
    "ends with space ",
    "\u0000 NUL char",
    "control \u0001\u0002\u0007\u001b[31mred\u001b[0m",
    "\U0001D400\U0001D401 math bold \U0001F9E0 brain \U00020000 ext-B",
    "\u03a3\u03c3\u03c2 sigma forms",
    "'s 's's 'S 'LL 'd'",
    "it's it\u2019s it\u02bcs",
    "x'y'z'",
    "'",
    "''",
    "a'",
    "123abc456def",
    "abc123def456ghi7890",
    "\u0661\u0662\u0663 \u0967\u0968\u0969 \uff11\uff12\uff13 other digits",
    "\u2160\u2161\u2162 roman \u00b2\u00b3 super",
]

POOLS = [
    "abcdefghijklmnopqrstuvwxyz",
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "0123456789",
    " " * 8 + "\t\n\r",
    ".,;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`",
    "\u00e0\u00e9\u00ee\u00f5\u00fc\u00e7\u00f1\u00df\u00f8\u00e5",
    "e\u0301a\u0300o\u0308n\u0303",
    "\u4f60\u597d\u4e16\u754c\u6a21\u578b\u6d4b\u8bd5\u6570\u636e\u4e2d\u6587",
    "\u3042\u3044\u3046\u30a2\u30a4\u30a6\u30fc",
    "\ud55c\uad6d\uc5b4\ud14d\uc2a4\ud2b8",
    "\u0627\u0644\u0639\u0631\u0628\u064a\u0629",
    "\u0939\u093f\u0902\u0926\u0940\u0915\u094d\u0937",
    "\u043f\u0440\u0438\u0432\u0435\u0442",
    "\U0001F600\U0001F680\U0001F468\u200d\U0001F4BB\u2764\ufe0f\U0001F44D\U0001F3FD",
    "\u2581\u00a0\u3000\u0085",
]

WORDS = ("the model of experts routes each token to a few of its many feed forward networks "
         "so that compute stays small while capacity grows; caching the hot experts in fast "
         "memory matters more than raw bandwidth").split()


def rand_string(rng):
    kind = rng.randrange(4)
    if kind == 0:  # random characters from 1-3 pools
        pools = rng.sample(POOLS, rng.randint(1, 3))
        return "".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 60)))
    if kind == 1:  # words with random separators and numbers
        out = []
        for _ in range(rng.randint(1, 25)):
            r = rng.random()
            if r < 0.6:
                w = rng.choice(WORDS)
                out.append(w.capitalize() if rng.random() < 0.2 else w)
            elif r < 0.75:
                out.append(str(rng.randint(0, 10 ** rng.randint(1, 12))))
            elif r < 0.9:
                out.append(rng.choice(POOLS[rng.randrange(5, len(POOLS))]) * rng.randint(1, 3))
            else:
                out.append(rng.choice(["'s", "'ll", "n't", "'re", "'VE", "'M"]))
            out.append(rng.choice([" ", " ", " ", "  ", "\n", ", ", ". ", "\t", "\r\n", ""]))
        return "".join(out)
    if kind == 2:  # whitespace-heavy
        return "".join(rng.choice([" ", "  ", "\n", "\t", "\r\n", "x", "y1", "\u00a0", "\n\n"])
                       for _ in range(rng.randint(1, 30)))
    # code-like
    idents = ["foo", "bar_baz", "qux2", "self", "ptr", "MAX_LEN", "i", "j"]
    parts = []
    for _ in range(rng.randint(1, 12)):
        parts.append(rng.choice(idents))
        parts.append(rng.choice([" = ", "(", ")", "->", ".", "[", "]", ";\n", " + ", "::",
                                 " == ", ",", "{\n    ", "\n}", "  # c\n", "\"str\"", "0x7f"]))
    return "".join(parts)


def document(rng):
    paras = []
    size = 0
    while size < 5000:
        p = []
        for _ in range(rng.randint(3, 8)):
            words = [rng.choice(WORDS) for _ in range(rng.randint(5, 15))]
            s = " ".join(words)
            s = s[0].upper() + s[1:] + rng.choice([".", "!", "?", ";", ":"])
            p.append(s)
        if rng.random() < 0.3:
            p.append(HAND[rng.randrange(len(HAND))])
        para = " ".join(p)
        paras.append(para)
        size += len(para.encode("utf-8")) + 2
    return "\n\n".join(paras)


def main():
    rng = random.Random(20240615)
    strings = list(HAND)
    while len(strings) < 300:
        strings.append(rand_string(rng))
    strings.append(document(rng))
    with open(sys.argv[1], "w", encoding="utf-8") as f:
        for s in strings:
            f.write(json.dumps(s) + "\n")


if __name__ == "__main__":
    main()
