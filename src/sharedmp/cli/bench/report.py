"""The table, the ratios, the targets and the plot of a bench report (``driver.py`` makes it)."""
import math

from .datasets import build_figures
from .plan import COLORS, DATASET_TARGETS, METRIC_UNITS, START_TARGETS, SYSTEMS, TARGETS
from .start import figure


def fmt_num(v):
    if v is None:
        return "-"
    if v >= 100:
        return f"{v:,.0f}"
    if v >= 10:
        return f"{v:.1f}"
    if v >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


def _fmt_ratio(v):
    if v is None:
        return "-"
    if v >= 100:
        return f"{v:,.0f}x"
    if v >= 10:
        return f"{v:.1f}x"
    return f"{v:.2g}x"


def _value(res, metric):
    if res is None or res.get("status") != "ok":
        return None
    v = res.get(metric)
    return v if isinstance(v, (int, float)) else None


def _ratio(a, b):
    return a / b if a is not None and b else None


def _mine(w):
    """The sharedmp column of workload ``w`` that the ratios are of (W7 has torch only)."""
    return "sharedmp" if "sharedmp" in w["systems"] else "sharedmp_torch"


def compute_ratios(report):
    out = {}
    bound = (report.get("bounds") or {}).get("alloc_fill_gbps")
    shm_bound = (report.get("bounds") or {}).get("shm_alloc_fill_gbps")
    for w in report["workloads"]:
        res = report["results"][w["id"]]
        for metric in w["metrics"]:
            mine = _value(res.get(_mine(w)), metric)
            r = {f"vs_{s}": _ratio(mine, _value(res.get(s), metric))
                 for s in ("torch_fd", "torch_fs", "torch_spawn", "stdlib")}
            if metric != "fds":        # W6: fewer is better; the target compares the counts
                r["torch_vs_numpy"] = _ratio(_value(res.get("sharedmp_torch"), metric),
                                             _value(res.get("sharedmp"), metric))
            if w["id"] == "W3" and metric == "gbps":
                r["vs_alloc_fill_bound"] = _ratio(mine, bound)
                r["vs_shm_alloc_fill_bound"] = _ratio(mine, shm_bound)
            out[f"{w['id']}:{metric}"] = r
    return out


def check_targets(report):
    out = []
    bounds = report.get("bounds") or {}
    for wid, metric, system, against, op, factor, text in TARGETS:
        if wid not in report["results"]:
            continue
        res = report["results"][wid]
        mine = _value(res.get(system), metric)
        kind = "absolute" if against is None else "compare" if factor is None else "ratio"
        if kind == "compare":          # the two figures, side by side
            theirs = _value(res.get(against), metric)
            got = None if mine is None or theirs is None else [mine, theirs]
            factor = theirs
        elif against is None:
            got = mine
        elif against == "alloc_fill":
            got = _ratio(mine, bounds.get("alloc_fill_gbps"))
        else:
            got = _ratio(mine, _value(res.get(against), metric))
        value = got[0] if kind == "compare" and got else got
        met = None if got is None else (value >= factor if op == ">=" else value <= factor)
        out.append({"target": text, "workload": wid, "value": got, "met": met, "kind": kind})
    return out


def check_start_targets(report):
    """The targets of the program rows: sharedmp's time over its baseline's, at most."""
    ratios = (report.get("start") or {}).get("ratios", {})
    out = []
    for wid, factor, text in START_TARGETS:
        if wid in ratios:
            got = ratios[wid]
            out.append({"target": text, "workload": wid, "value": got,
                         "met": None if got is None else got <= factor, "kind": "ratio"})
    return out


def _dataset_value(measure, res, ratios, records):
    """The figure that target ``measure`` of a dataset row checks (form, build: of the
    ``records`` rows' results); None if it is missing."""
    if measure == "workers":           # the shared form's memory, 4 workers over 1
        one, four = ((res.get(k) or {}).get("shared") or {} for k in ("1", "4"))
        if one.get("status") == four.get("status") == "ok" and one["memory_mib"] > 0:
            return four["memory_mib"] / one["memory_mib"]
        return None
    if measure == "time":              # shared over plain, the worst of the worker counts
        got = [r["time"] for r in ratios.values()]
        return max(got) if got and None not in got else None
    figures = build_figures(records)
    if figures is None:
        return None
    if measure == "form":
        return _ratio(figures["form_mib"], figures["private_mib"])
    return _ratio(figures["build_s"], figures["pickle_s"])          # "build"


def _records_rows(section):
    return [w["id"] for w in section.get("workloads", []) if w["dataset"] == "records"]


def check_dataset_targets(report):
    """The targets of the dataset rows (D1-D6); those of the records' shared form and build
    time are of every records row of the report (listed under the first)."""
    section = report.get("datasets") or {}
    results, ratios = section.get("results", {}), section.get("ratios", {})
    records = _records_rows(section)
    out = []
    for wid, measure, op, factor, text in DATASET_TARGETS:
        if measure in ("form", "build"):
            wid = records[0] if records else None
        if wid not in results:
            continue
        got = _dataset_value(measure, results[wid], ratios[wid],
                             [results[k] for k in records])
        met = None if got is None else got <= factor if op == "<=" else got < factor
        out.append({"target": text, "workload": wid, "value": got, "met": met, "kind": "ratio"})
    return out


def _start_cell(w, res):
    if res is None:
        return ""
    if res.get("status") != "ok":
        return res.get("status", "-")
    if w["kind"] == "import":
        heavy = f", with {' '.join(res['heavy'])}" if res.get("heavy") else ""
        return f"{fmt_num(res['ms'])} ({res['modules']} modules{heavy})"
    if w["kind"] == "small":
        extra = f"p90 {fmt_num(res['p90_us'])}" if "p90_us" in res else \
            f"{fmt_num(res['msgs'])}/s" if "msgs" in res else ""
        return f"{fmt_num(res['us'])}" + (f" ({extra})" if extra else "")
    return fmt_num(res[figure(w)])


def _start_label(w, res):
    """The first column of program row ``w``; a skipped row says why."""
    if w["kind"] == "import":
        label = f"{w['id']} {w['title']}, median of {w['n']}"
    elif w["kind"] == "frame":
        size = next((r["bytes"] for r in res.values() if r.get("status") == "ok"), None)
        label = f"{w['id']} {w['title']}, {w['rows']:,} rows" + \
            (f" ({size / 1e6:.0f} MB)" if size else "")
    else:
        label = f"{w['id']} {w['n']:,} x {w['title']}"
    skipped = [r.get("error") for r in res.values() if r.get("status") == "n/a"]
    return label + (f" [n/a: {skipped[0]}]" if skipped else "")


def _runs(n):
    return f"{n} run{'s' if n != 1 else ''}"


def _start_notes(section, ws):
    return ["S1: the import statement in a fresh `python -c`; S2-S6: a fresh script per run, "
            f"timed from its first round to its last, best of {_runs(section['runs'])};",
            "    smp/base time: sharedmp's time over the standard library's (S1-S4) or loky's "
            "(S5-S6): lower is better"]


def _frame_notes(section, ws):
    return ["F1-F3: one message through a spawn Queue to a child that reads its last row (a "
            "value of each column) and answers;",
            "    8 float64 columns + 1 string column; ms from put() to the answer, best of "
            f"{ws[0]['n']} messages x {_runs(section['runs'])} (each a fresh script, a warm-up "
            "message first);",
            "    smp/stdlib time: sharedmp's time over the standard library's (which pickles the "
            "Arrow buffers by value): lower is better"]


def _small_notes(section, ws):
    res = section["results"]
    lines = ["L1-L12: spawn; a fresh script per run, best of at least 3 runs (one CPU or two for "
             "the two processes changes a round trip 4x; torch: of the runs asked for, 5 in a "
             "full run);",
             "    round trips: the median (p90); maps: per item; streams: per message (msg/s), "
             "from warm producers that make each item as they put it;",
             "    smp/stdlib time: sharedmp's over the standard library's (L6: the standard "
             "library's Queue with sharedmp imported, over without); smp/torch time: over "
             "torch.multiprocessing's (its tensors in L9-L10, NumPy arrays pickled elsewhere): "
             "lower is better"]
    for burst, steady in (("L7", "L8"), ("L9", "L10")):
        b, s = ((res.get(k) or {}).get("sharedmp") or {} for k in (burst, steady))
        if b.get("status") == "ok" and s.get("status") == "ok":
            ratio = s["us"] / b["us"]
            lines.append(f"    {burst}/{steady}: sharedmp's burst rate is {ratio:.2f}x its steady "
                         "rate")
    return lines


# The tables of the program rows: (title, its rows' kinds, its systems, its ratio columns
# (title, the system sharedmp's time is over; None: the row's baseline), notes)
START_TABLES = [
    ("process start", ("import", "pool", "joblib"), ("sharedmp", "stdlib", "loky"),
     [("smp/base time", None)], _start_notes),
    ("data frames, one message", ("frame",), ("sharedmp", "stdlib"),
     [("smp/stdlib time", None)], _frame_notes),
    ("small messages", ("small",), ("sharedmp", "stdlib", "torch_mp"),  # (torch_mp: L rows)
     [("smp/stdlib time", None), ("smp/torch time", "torch_mp")], _small_notes),
]


def format_start(report):
    """The program rows: a table for process start, one for data frames (times: lower is
    better); a table none of whose rows ran is left out."""
    section = report["start"]
    lines = []
    for title, kinds, systems, ratios, notes in START_TABLES:
        ws = [w for w in section["workloads"] if w["kind"] in kinds]
        if not ws:
            continue
        rows = []
        for w in ws:
            res = section["results"][w["id"]]
            vs = section.get("vs", {}).get(w["id"], {})
            rows.append([_start_label(w, res), w["unit"]]
                        + [_start_cell(w, res.get(s)) for s in systems]
                        + [_fmt_ratio(section["ratios"].get(w["id"]) if s is None else vs.get(s))
                           for _, s in ratios])
        lines += ([""] if lines else []) + _aligned(
            [title, "unit", *systems, *(t for t, _ in ratios)], rows) + [""] + notes(section, ws)
    return "\n".join(lines)


def _dataset_cell(res, key):
    if res is None:
        return ""
    if res.get("status") != "ok":
        return res.get("status", "-")
    return fmt_num(res[key]) if res[key] >= 0 else f"{res[key]:.2g}"


def _dataset_notes(section):
    lines = ["D1-D6: torch DataLoader(shuffle=True, persistent_workers=True, default collate; "
             "batches of 1,024 records, 256 array rows), a fresh program per figure;",
             "    plain: the dataset as is, multiprocessing_context=method (torch's context); "
             "shared: mp.share_dataset(ds), mp.get_context(method);",
             "    MiB: Pss (smaps_rollup: anonymous + shared memory, files left out) of the "
             "program and every process under it at the end",
             "    of the last epoch, minus the same for a tiny dataset (a batch per worker) "
             "measured first in the same program;",
             "    s/epoch: the mean of the epochs, iter() to the last batch, the first with the "
             "workers' start; smp/plain: shared over plain,",
             "    lower is better"]
    records = _records_rows(section)
    f = build_figures([section["results"][k] for k in records])
    if f:
        rows = records[0] if len(records) == 1 else f"{records[0]}-{records[-1]}"
        lines.append(
            f"{rows} records, medians of the shared runs: the list "
            f"{f['private_mib']:.1f} MiB of Pss, its shared form {f['form_mib']:.1f} MiB "
            f"({_fmt_ratio(_ratio(f['form_mib'], f['private_mib']))}); mp.share_dataset "
            f"{f['build_s']:.2f} s, pickle.dumps of each record (protocol 5) "
            f"{f['pickle_s']:.2f} s ({_fmt_ratio(_ratio(f['build_s'], f['pickle_s']))})")
    return lines


def format_datasets(report):
    """The dataset rows: per (row, workers), the memory and time of the plain and shared
    forms (lower is better)."""
    section = report["datasets"]
    head = ["datasets, DataLoader (persistent workers)", "workers", "plain MiB", "shared MiB",
            "smp/plain MiB", "plain s/epoch", "shared s/epoch", "smp/plain time"]
    rows = []
    for w in section["workloads"]:
        res, ratios = section["results"][w["id"]], section["ratios"][w["id"]]
        for i, k in enumerate(res):
            label = w["id"]
            if i == 0:
                label = f"{w['id']} {w['n']:,} {w['title']}"
                skipped = [r.get("error") for r in res[k].values() if r.get("status") == "n/a"]
                label += f" [n/a: {skipped[0]}]" if skipped else ""
            pair = res[k]
            rows.append([label, k] + [_dataset_cell(pair.get(v), "memory_mib")
                                      for v in ("plain", "shared")]
                        + [_fmt_ratio(ratios[k]["memory"])]
                        + [_dataset_cell(pair.get(v), "epoch_s") for v in ("plain", "shared")]
                        + [_fmt_ratio(ratios[k]["time"])])
    return "\n".join(_aligned(head, rows) + [""] + _dataset_notes(section))


def _cell(res, metric):
    if res is None:
        return "n/a"
    status = res.get("status")
    if status != "ok":
        return status
    v = _value(res, metric)
    if metric == "fds":
        return f"{v:,}" if v is not None else "-"
    return fmt_num(v)


def _label(w, res, k):
    """The first column of the ``k``-th row of workload ``w``."""
    if k > 0:
        return f"{w['id']}"
    label = f"{w['id']} {w['n']:,} x {w['title']}"
    if w["id"] == "W6":
        label = f"{w['id']} {w['title']} ({w['n']:,})"
    if w.get("stdlib_fraction"):
        sn = (res.get("stdlib") or {}).get("n")
        if sn:
            label += f" [stdlib: {sn:,}, by value]"
    return label


def _rows(report):
    rows = []
    for w in report["workloads"]:
        res = report["results"][w["id"]]
        for k, metric in enumerate(w["metrics"]):
            ratios = report["ratios"][f"{w['id']}:{metric}"]
            bound = _fmt_ratio(ratios.get("vs_alloc_fill_bound")) \
                if "vs_alloc_fill_bound" in ratios else ""
            rows.append([_label(w, res, k), METRIC_UNITS[metric]]
                        + [_cell(res.get(s), metric) for s, _ in SYSTEMS]
                        + [_fmt_ratio(ratios["vs_torch_fd"]), _fmt_ratio(ratios["vs_stdlib"]),
                           bound, _fmt_ratio(ratios.get("torch_vs_numpy"))])
    return rows


def _aligned(head, rows):
    """The lines of a table: the first two columns to the left, the others to the right."""
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    sep = "  "

    def line(r):
        return sep.join((str(c).ljust(widths[i]) if i < 2 else str(c).rjust(widths[i]))
                        for i, c in enumerate(r)).rstrip()
    return [line(head), sep.join("-" * w for w in widths)] + [line(r) for r in rows]


def _w7_notes(report):
    w7 = report["results"].get("W7")
    if not w7:
        return []
    vs_spawn = ""
    if "W7:batches" in report["ratios"]:
        ratio = _fmt_ratio(report["ratios"]["W7:batches"]["vs_torch_spawn"])
        vs_spawn = f" (sharedmp torch / torch spawn: {ratio})"
    lines = ["",
             "W7: batches/s in the main process, from the 2nd batch (one per worker: start-up "
             "excluded) to the last; DataLoader(num_workers=2,",
             "    batch_size=64, default collate, timeout), a fresh one per round;",
             "    smp/torch fd = sharedmp torch / torch fd, torch's default DataLoader "
             "(multiprocessing_context=None: fork on Linux,",
             "    file_descriptor): what unchanged torch code gets, so the target's baseline; "
             "torch spawn isolates the start method" + vs_spawn]
    ups = [f"{t} {min(w7[s]['startup_s']):.2f} s" for s, t in SYSTEMS
           if (w7.get(s) or {}).get("status") == "ok"]
    if ups:
        lines.append("    start-up, iter() to the 2nd batch (best round): " + ", ".join(ups))
    return lines


def _bounds_lines(report):
    bounds = report.get("bounds") or {}
    if bounds.get("status") != "ok":
        return [f"machine bounds: {bounds.get('status', 'n/a')}"]
    lines = ["", f"machine bounds: memcpy (np.copyto 64 MiB) {bounds['memcpy_gbps']:.2f} GB/s;  "
                 f"alloc+fill (np.empty 64 MiB + fill) {bounds['alloc_fill_gbps']:.2f} GB/s;  "
                 f"Pipe round trips {bounds['pipe_roundtrips_per_s']:,.0f}/s"]
    if bounds.get("shm_alloc_fill_gbps"):
        w3 = report["ratios"].get("W3:gbps", {}).get("vs_shm_alloc_fill_bound")
        no_thp = bounds.get("alloc_fill_4k_gbps")
        indent = " " * 16
        lines.append(indent
                     + (f"alloc+fill without huge pages {no_thp:.2f} GB/s;  " if no_thp else "")
                     + "fresh shared memory (memfd 64 MiB + fill) "
                     + f"{bounds['shm_alloc_fill_gbps']:.2f} GB/s"
                     + (f" (W3 sharedmp / this: {_fmt_ratio(w3)})" if w3 else ""))
        machine = report["machine"]
        lines.append(f"{indent}huge pages: anonymous {machine.get('transparent_hugepages', '?')}; "
                     f"shmem {machine.get('shmem_hugepages', '?')}")
    return lines


def format_table(report):
    head = (["workload", "unit"] + [t for _, t in SYSTEMS]
            + ["smp/torch fd", "smp/stdlib", "smp/bound", "smp torch/numpy"])
    lines = _aligned(head, _rows(report)) + _w7_notes(report) + _bounds_lines(report)
    return "\n".join(lines)


def format_header(report):
    m, v = report["machine"], report["versions"]
    mode = "quick" if report["quick"] else ("full" if report["scale"] == 1 else "scaled")
    how = (f"best of {report['rounds']} timed round{'s' if report['rounds'] != 1 else ''}, "
           f"spawn, fresh processes per {report['isolation']}" if report["workloads"]
           else "program rows only")
    return (f"sharedmp bench ({mode}: scale {report['scale']:g}, {how})\n"
            f"{m.get('cpu', m['machine'])}, {m.get('cpus_usable', m['cpus'])} CPUs, "
            f"{m.get('memory_gib', '?')} GiB; Python {v['python']}, numpy {v['numpy']}, "
            f"torch {v['torch'] or 'n/a'}, sharedmp {v['sharedmp']}")


def format_footer(report):
    lines = ["", "targets:"]
    for t in report["targets"]:
        if t["value"] is None:
            val, mark = "n/a", "?"
        else:
            val = _fmt_ratio(t["value"]) if t["kind"] == "ratio" else \
                " vs ".join(f"{v:,}" if isinstance(v, int) else fmt_num(v) for v in
                            (t["value"] if t["kind"] == "compare" else [t["value"]]))
            mark = "met" if t["met"] else "MISSED"
        lines.append(f"  {t['target']:<40} {val:>10}  {mark}")
    left = report.get("shm_left", [])
    lines.append("")
    lines.append("/dev/shm after the run: " + ("clean" if not left else "LEFT " + ", ".join(left)))
    if report.get("shm_removed"):
        lines.append("  removed after a timeout: " + ", ".join(report["shm_removed"]))
    for s in report.get("problems", []):
        lines.append("problem: " + s)
    lines.append(f"wall time {report['wall_s']:.1f} s")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- plot

def _base(metric, good):
    """The bottom of a panel's log scale, below its smallest bar."""
    if metric == "fds":
        return 0.5
    lo = min(good) if good else 1
    return 10 ** (int(math.floor(math.log10(lo))) - 1) if lo > 0 else 0.1


def _w3_bound_lines(ax, bounds, top):
    """W3's panel: the machine's bounds as horizontal lines; the panel's new top."""
    lines = []
    for key, text, style in (("alloc_fill_gbps", "np.empty+fill (bound)", "--"),
                             ("alloc_fill_4k_gbps", "np.empty+fill, no huge pages", "-."),
                             ("shm_alloc_fill_gbps", "fresh shared memory+fill", ":")):
        b = bounds.get(key)
        if b:
            lines.append(ax.axhline(b, color="black", linestyle=style, linewidth=1,
                                    label=f"{text}: {b:.2f}"))
            top = max(top, b * 60)
    if lines:
        ax.legend(handles=lines, loc="upper right", fontsize=7.5, framealpha=0.9)
    return top


def _bar_labels(ax, bars, vals, shown, res, metric, base):
    """Each bar's figure above it; a failed system's status where its bar would be."""
    for bar, v, (s, _) in zip(bars, vals, shown):
        x = bar.get_x() + bar.get_width() / 2
        if v == 0:
            ax.text(x, base * 1.15, "0", ha="center", va="bottom", fontsize=9)
        elif v:
            label = fmt_num(v) if metric != "fds" else f"{int(v):,}"
            ax.text(x, v * 1.15, label, ha="center", va="bottom", fontsize=9,
                    fontweight="bold" if s.startswith("sharedmp") else "normal",
                    bbox=dict(facecolor="white", edgecolor="none", pad=0.5, alpha=0.8))
        else:
            ax.text(x, base * 1.3, _cell(res.get(s), metric), ha="center", va="bottom",
                    fontsize=9, color="darkred", rotation=90)


def _panel_title(w, res):
    if w["id"] == "W6":
        title = f"W6: fds held for {w['n']:,} live 1 KiB arrays"
    else:
        title = f"{w['id']}: {w['n']:,} x {w['title']}"
    sn = (res.get("stdlib") or {}).get("n")
    if w.get("stdlib_fraction") and sn:
        title += f"\n(stdlib: {sn:,} messages, by value)"
    return title


def _panel(ax, w, metric, report):
    """One workload's bars, one per system that runs it (log scale)."""
    res = report["results"][w["id"]]
    shown = [(s, t) for s, t in SYSTEMS if s in w["systems"]]
    vals = [_value(res.get(s), metric) for s, _ in shown]
    good = [v for v in vals if v]   # 0 fds: no bar, a label
    base = _base(metric, good)
    xs = range(len(shown))
    bars = ax.bar(xs, [(v - base if v else 0) for v in vals], bottom=base,
                  color=[COLORS[s] for s, _ in shown], edgecolor="black", linewidth=0.5)
    ax.set_yscale("log")
    top = max(max(good) if good else 10, base * 10) * 8
    if w["id"] == "W3":
        top = _w3_bound_lines(ax, report.get("bounds") or {}, top)
    ax.set_ylim(base, top)
    _bar_labels(ax, bars, vals, shown, res, metric, base)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([t for _, t in shown], fontsize=8, rotation=15)
    ax.set_title(_panel_title(w, res), fontsize=9.5)
    unit = METRIC_UNITS[metric]
    ax.set_ylabel(unit + ("" if metric == "fds" else " (higher is better)"), fontsize=9)
    ax.grid(axis="y", which="major", alpha=0.3)


def _subtitle(report):
    m, bounds = report["machine"], report.get("bounds") or {}
    sub = (f"{m.get('cpu', '')}, {m.get('cpus_usable', m['cpus'])} CPUs; spawn; best of "
           f"{report['rounds']}; scale {report['scale']:g}")
    if bounds.get("status") == "ok":
        sub += (f"; memcpy {bounds['memcpy_gbps']:.1f} GB/s, alloc+fill "
                f"{bounds['alloc_fill_gbps']:.1f} GB/s, "
                f"Pipe {bounds['pipe_roundtrips_per_s']:,.0f} round trips/s")
    return sub


def plot(report, path):
    """A bar chart per workload (log scale), one bar per system; writes ``path``."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'sharedmp[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(w, "gbps" if "gbps" in w["metrics"] else w["metrics"][0])
              for w in report["workloads"]]
    ncols = min(4, len(panels))
    nrows = (len(panels) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 4.0 * nrows), squeeze=False)
    for ax, (w, metric) in zip(axes.flat, panels):
        _panel(ax, w, metric, report)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle("sharedmp vs torch.multiprocessing vs multiprocessing (log scale)\n"
                 + _subtitle(report), fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
