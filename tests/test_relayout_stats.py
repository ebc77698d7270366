"""relayout's pass stats (relayout/stats.py): the summary JSON is the passes'
shares merged in pass order, and each share prints its own lines."""

import json

from linepack.relayout import stats as S

KEYS_FUNCTION = {"static_keys.sites_rechecked": 5980, "static_keys.two_byte": 3145,
                 "static_keys.five_byte": 2835, "static_keys.five_byte_in_rel8_reach": 0,
                 "static_keys.illegal": 0}
KEYS_BLOCK = {"static_keys.sites_rechecked": 5980, "static_keys.made_short": 11,
              "static_keys.made_long": 43, "static_keys.unchanged": 5926,
              "static_keys.two_byte": 3113, "static_keys.five_byte": 2867,
              "static_keys.five_byte_in_rel8_reach": 0}


def test_static_keys_one_statement():
    """Function level: sizes kept; block level: before, what relayout chose, after
    (3113 - 11 + 43 = 3145 2-byte sites before, as the function-level census says)."""
    (f,) = S.StaticKeyStats(dict(KEYS_FUNCTION)).lines()
    assert f == ("  static keys:       5980 sites, sizes kept (functions move whole): 3145 2-byte "
                 "(all reach their target), 2835 5-byte (0 of them within rel8 reach)")
    (b,) = S.StaticKeyStats(dict(KEYS_BLOCK)).lines()
    assert b == ("  static keys:       5980 sites: 3145 2-byte + 2835 5-byte before; relayout made "
                 "11 short, 43 long, kept 5926; after: 3113 2-byte (all reach their target), "
                 "2867 5-byte (0 of them within rel8 reach)")
    assert S.StaticKeyStats({}).lines() == []         # no __jump_table: nothing to say


def test_summary_merges_in_pass_order():
    plan = S.PlanStats("blocks", units=10, units_moved=7, functions_moved=9, hot_units=2,
                       hot_text_bytes=300)
    split = S.SplitStats(functions_split=1, hot_functions_by_reason={"split": 1}, blocks=40,
                         block_map={"rows": 5, "copied": 3, "branch": 1, "jmp_inserted": 1,
                                    "jmp_removed": 0})
    code = S.CodeStats({"units_moved": 7, "symbols_updated": 4})
    keys = S.StaticKeyStats(dict(KEYS_BLOCK))
    dwarf = S.DwarfStats("dropped")
    metrics = S.MetricsStats(hot_functions=2, hot_lines_before=9, hot_lines_after=5,
                             padding_bytes=64, text_growth_bytes=16, text_growth_pct=0.5,
                             problems=[("x", 0x1000, "why")])
    s = S.RelayoutSummary([("split", split), ("plan", plan), ("code", code),
                           ("static keys", keys), ("DWARF", dwarf), ("summary", metrics)])
    assert s["units_moved"] == 7 and s["symbols_updated"] == 4
    assert s["strategy"] == "blocks" and s["dwarf"] == "dropped"
    assert s["split"]["rows"] == 5 and s["split"]["functions_split"] == 1
    assert s["problems"] == [{"kind": "x", "address": "0x1000", "message": "why"}]
    assert "blocks" not in s                  # no block metric at function granularity here
    json.dumps(s)                             # the summary JSON is the dict itself
    lines = s.lines()
    # the layout's figures first, then each pass in order, the problems last
    assert lines[0].startswith("  functions moved:   9 (7 units of 10)")
    assert lines[2].startswith("  padding:           64 bytes; .text growth +16 bytes")
    assert [ln.split(":")[0].strip() for ln in lines[4:]] == [
        "block split", "hot functions split", "static keys", "DWARF", "problem"]
