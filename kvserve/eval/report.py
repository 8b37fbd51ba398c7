"""`kvserve eval`'s answer as a rich table and PNG plots."""
from __future__ import annotations

from pathlib import Path


def render(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    base = report["results"][0]
    table = Table(title=f"{report['model']}: {report['scored_tokens']:,} tokens of {report['text']} in windows of "
                        f"{report['settings']['context']:,}, scored {report['settings']['chunk']} at a time")
    for column in ("options", "KV B/token", "tokens/GiB", "KV held", "perplexity", "ΔPPL", "KL (mean)", "top-1 agree", "passkey",
                   "decode tok/s"):
        table.add_column(column, justify="left" if column == "options" else "right", no_wrap=column == "options")
    for r in report["results"]:
        table.add_row(r["name"], f"{r['kv_bytes_per_token']:,.0f}",
                      f"{r['tokens_per_gib']:,.0f} ({r['tokens_per_gib'] / base['tokens_per_gib']:.2f}x)",
                      f"{r['kv_bytes_held'] / 2**20:,.1f} MiB ({r['kv_bytes_held'] / base['kv_bytes_held']:.2f}x)",
                      f"{r['perplexity']:.3f}", f"{r['delta_ppl']:+.2%}", f"{r['kl_mean']:.2e}", f"{r['top1_agreement']:.1%}",
                      f"{r['passkey_accuracy']:.0%}", f"{r['decode_tok_s']:.1f} ({r['decode_tok_s'] / base['decode_tok_s']:.2f}x)")
    console = Console(width=max(Console().width, 190))  # the table's columns, whole, even when piped
    console.print(table)
    depths = report["settings"]["passkey_depths"]
    console.print("passkey found, by context length (rows) and depth % (columns " + ", ".join(map(str, depths)) + "):")
    for r in report["results"]:
        cells = "  ".join(f"{n}: " + "".join("x" if row[str(d)] == 1 else ("." if row[str(d)] == 0 else "~") for d in depths)
                          for n, row in r["passkey"].items())
        console.print(f"  {r['name']:<40} {cells}")


def plot(report: dict, directory: str) -> list[Path]:
    """perplexity.png (perplexity against KV bytes per token, a point per option set) and passkey.png (a heatmap
    of retrieval per option set); returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    results = report["results"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        ax.scatter(r["kv_bytes_per_token"], r["perplexity"])
        ax.annotate(r["name"], (r["kv_bytes_per_token"], r["perplexity"]), fontsize=8, xytext=(4, 4), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("KV bytes per token (log)")
    ax.set_ylabel("perplexity")
    ax.set_title(f"{report['model']}: perplexity against KV size")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    paths = [out / "perplexity.png"]
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)

    depths, lengths = report["settings"]["passkey_depths"], [str(n) for n in report["settings"]["passkey_lengths"]]
    fig, axes = plt.subplots(1, len(results), figsize=(3.2 * len(results), 3), squeeze=False)
    for ax, r in zip(axes[0], results):
        grid = [[r["passkey"][n][str(d)] for d in depths] for n in lengths]
        ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(depths)), [f"{d}%" for d in depths])
        ax.set_yticks(range(len(lengths)), lengths)
        ax.set_title(r["name"], fontsize=8)
        ax.set_xlabel("depth")
    axes[0][0].set_ylabel("context tokens")
    fig.tight_layout()
    paths.append(out / "passkey.png")
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)
    return paths
