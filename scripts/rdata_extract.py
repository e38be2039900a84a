#!/usr/bin/env python3
"""Extracts one character vector from an R lazy-load database as plain text.

Usage: rdata_extract.py BASE NAME OUT
  BASE  path without extension of the `.rdx` index and `.rdb` records
        (e.g. .../janeaustenr/data/Rdata)
  NAME  variable to extract (e.g. persuasion); `--list` prints the names
  OUT   output text file, one element per line (NA elements become empty)

Format (R internals manual, "Serialization Formats" and lazy loading): the
`.rdx` index and each `.rdb` record are a 4-byte big-endian uncompressed
length followed by a zlib stream of an R XDR serialization ("X\\n", version
2 or 3). The index is a named list whose `variables` element maps each name
to an integer pair (offset, length) into `.rdb`. Only what character data
needs is decoded; other types are skipped structurally.
"""
import struct
import sys
import zlib


class Reader:
    def __init__(self, buf):
        self.b = buf
        self.p = 0
        self.refs = []

    def int(self):
        (v,) = struct.unpack_from(">i", self.b, self.p)
        self.p += 4
        return v

    def length(self):
        n = self.int()
        if n == -1:
            hi, lo = self.int(), self.int()
            n = (hi << 32) | (lo & 0xFFFFFFFF)
        return n

    def header(self):
        fmt = self.b[:2]
        if fmt != b"X\n":
            raise ValueError(f"not an XDR R serialization (starts {fmt!r})")
        self.p = 2
        version = self.int()
        self.int()  # writer R version
        self.int()  # minimal reader version
        if version == 3:
            n = self.int()
            self.p += n  # native encoding name
        elif version != 2:
            raise ValueError(f"unsupported serialization version {version}")

    def item(self):
        flags = self.int()
        t = flags & 0xFF
        has_attr = bool(flags & (1 << 9))
        has_tag = bool(flags & (1 << 10))
        if t == 254 or t in (253, 252, 251, 250, 242, 241):  # NILVALUE, specials
            return None
        if t == 255:  # REFSXP
            idx = flags >> 8
            if idx == 0:
                idx = self.int()
            return self.refs[idx - 1]
        if t in (247, 248, 249):  # PERSIST, PACKAGE, NAMESPACE: a string vector
            self.int()  # 0
            n = self.int()
            val = [self.item() for _ in range(n)]
            self.refs.append(("ns", val))
            return self.refs[-1]
        if t == 238:  # ALTREP: info, state, attributes
            info = self.item()
            state = self.item()
            self.item()
            return ("altrep", info, state)
        if t == 1:  # SYMSXP
            name = self.item()
            self.refs.append(("sym", name))
            return self.refs[-1]
        if t == 4:  # ENVSXP
            self.int()  # locked
            env = {"env": True}
            self.refs.append(env)
            self.item()  # enclosure
            env["frame"] = self.item()
            env["hashtab"] = self.item()
            self.item()  # attributes
            return env
        if t in (2, 3, 5, 6, 17, 239, 240):  # pairlist-like
            attr = self.item() if has_attr else None
            tag = self.item() if has_tag else None
            car = self.item()
            cdr = self.item()
            return ("pair", tag, car, cdr, attr)
        if t == 9:  # CHARSXP
            n = self.int()
            if n == -1:
                return None
            s = self.b[self.p : self.p + n]
            self.p += n
            return s.decode("utf-8", errors="replace")
        if t in (10, 13):  # LGLSXP, INTSXP
            n = self.length()
            v = list(struct.unpack_from(f">{n}i", self.b, self.p))
            self.p += 4 * n
        elif t == 14:  # REALSXP
            n = self.length()
            v = list(struct.unpack_from(f">{n}d", self.b, self.p))
            self.p += 8 * n
        elif t == 15:  # CPLXSXP
            n = self.length()
            self.p += 16 * n
            v = None
        elif t == 24:  # RAWSXP
            n = self.length()
            v = self.b[self.p : self.p + n]
            self.p += n
        elif t in (16, 19, 20):  # STRSXP, VECSXP, EXPRSXP
            n = self.length()
            v = [self.item() for _ in range(n)]
        elif t in (21, 22, 23, 25):  # BCODE etc.: not expected in data
            raise ValueError(f"unsupported SEXP type {t}")
        else:
            raise ValueError(f"unsupported SEXP type {t} at byte {self.p}")
        attr = self.item() if has_attr else None
        return ("vec", t, v, attr)


def pairlist(obj):
    """A serialized pairlist as a dict tag name -> value."""
    out = {}
    while obj is not None and obj[0] == "pair":
        _, tag, car, cdr, _ = obj
        name = tag[1] if tag is not None and tag[0] == "sym" else None
        out[name] = car
        obj = cdr
    return out


def unpack_record(raw):
    if raw[:2] == b"\x1f\x8b":
        import gzip

        return gzip.decompress(raw)
    (n,) = struct.unpack_from(">I", raw, 0)
    data = zlib.decompress(raw[4:])
    if len(data) != n:
        raise ValueError(f"record length {len(data)} != header {n}")
    return data


def parse(buf):
    r = Reader(buf)
    r.header()
    return r.item()


def names_of(vec):
    attrs = pairlist(vec[3])
    names = attrs.get("names")
    return names[2] if names else []


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    base, name, out = sys.argv[1:]
    with open(base + ".rdx", "rb") as f:
        index = parse(unpack_record(f.read()))
    top = dict(zip(names_of(index), index[2]))
    variables = top["variables"]
    table = dict(zip(names_of(variables), variables[2]))
    if name == "--list":
        print("\n".join(table))
        return
    if name not in table:
        sys.exit(f"{name!r} not in {base}.rdx; has: {', '.join(table)}")
    off, ln = table[name][2]
    with open(base + ".rdb", "rb") as f:
        f.seek(off)
        raw = f.read(ln)
    obj = parse(unpack_record(raw))
    if obj[0] != "vec" or obj[1] != 16:
        sys.exit(f"{name!r} is not a character vector")
    lines = [s if s is not None else "" for s in obj[2]]
    with open(out, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
