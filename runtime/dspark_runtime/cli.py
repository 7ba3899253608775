"""`dspark-run`: the runtime's command line."""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict
from typing import TYPE_CHECKING

import click

from dspark_common.cli_common import DSparkGroup, parse_size, prompt_options
from dspark_common.prompts import DEMO_NOTE, DEMO_PROMPT

if TYPE_CHECKING:
    from dspark_runtime.engine import Completion, Engine
    from dspark_runtime.output import Delta
    from dspark_common.sampling import SamplingParams


def shared_pool() -> bool:
    """The commands run both graphs on ONNX Runtime's process-wide thread pool unless DSPARK_THREAD_POOL=session."""
    return os.environ.get("DSPARK_THREAD_POOL", "process") != "session"


def engine_options(command):
    """ENGINE (default: the bundled demo), --drafter, --threads and --exact-greedy, shared by every command that loads
    an engine (--drafter and --exact-greedy reach `load_engine` through click's context)."""
    command = click.option("--threads", type=click.IntRange(min=1), default=None,
                           help="ONNX Runtime threads (default: all cores).")(command)
    command = click.option(
        "--exact-greedy/--no-exact-greedy", default=None, expose_value=False,
        callback=lambda ctx, param, value: ctx.meta.__setitem__("exact_greedy", value),
        help="Every step runs an even number of rows, at least two, so greedy output is the same in every mode even "
             "on a CPU whose kernels compute a lone row otherwise (`profile` says so); plain steps cost more. "
             "Default: on for w8a8 and w4a8 engines and GGUF K-quant ones (a second row of integer products costs "
             "little) built before their target had DSpark's own attention (exact without pairs), off for the others."
             )(command)
    command = click.option(
        "--drafter", default=None, expose_value=False,
        callback=lambda ctx, param, value: ctx.meta.__setitem__("drafter", value),
        help="With a model file: the drafter to build its engine with (a bundled name such as demo-dspark, or a "
             "folder; default: a bundled one trained for that model, else plain decoding).")(command)
    return click.argument("engine_dir", metavar="[ENGINE]", required=False)(command)


json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object (with -p: the reply).")


def load_engine(engine_dir: str | None, threads: int | None, **options) -> Engine:
    """The engine a command runs, on the thread pool `shared_pool` says. ENGINE is an engine folder, or a model the
    exporter builds an engine of on first use (the runtime's one call into the exporter): a GGUF file, a store name
    (ollama:NAME, lmstudio:ORG/REPO, hf:ORG/REPO), a Hugging Face model folder; none is the bundled demo."""
    from pathlib import Path

    from dspark_common.engine_dir import MANIFEST
    from dspark_runtime.backend import OrtBackend
    from dspark_runtime.engine import Engine

    context = click.get_current_context(silent=True)
    meta = context.meta if context else {}
    drafter = meta.get("drafter")
    if engine_dir is None and drafter is None:
        from dspark_export.cached_engines import demo_engine

        engine_dir = demo_engine()
    elif engine_dir is None or not (Path(engine_dir).expanduser() / MANIFEST).is_file():
        from dspark_export.cached_engines import model_engine

        engine_dir = model_engine(engine_dir, drafter)
    elif drafter is not None:
        raise click.UsageError(f"{engine_dir} is a built engine with its drafter; --drafter is for a model file")
    return Engine.load(engine_dir, OrtBackend(threads, shared_pool=shared_pool()),
                       exact_greedy=meta.get("exact_greedy"), **options)


def int_list(ctx: click.Context | None, param: click.Parameter | None, text: str) -> list[int]:
    """click callback: "1,4,8" -> [1, 4, 8]."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise click.BadParameter("values must be positive integers")
    return values


class ChatByDefault(DSparkGroup):
    """`dspark-run [ENGINE_DIR] [options]` is the chat command; subcommands keep their names."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args or (args[0] not in self.commands and args[0] not in ("--help", "-h", "--version")):
            args = ["chat", *args]
        return super().parse_args(ctx, args)


@click.group(cls=ChatByDefault)
def main() -> None:
    """Chat with a DSpark engine (the default command), or benchmark, profile and calibrate it.

    \b
    dspark-run                      chat with the bundled demo (its engine is built on first use)
    dspark-run ENGINE -p "hi"       one-shot answer (ENGINE: an engine folder)
    dspark-run FILE.gguf            your model file, its engine built on first use (also ollama:NAME)
    """


DEMO_INTRO = DEMO_NOTE + "\nTry: {prompt}\n(press Enter to send it)"
DRAFT_COLOUR = "cyan"


def summary_line(reply: Completion, speedup: float | None = None) -> str:
    """The figures after a reply: τ is tokens per target step; drafts are counted per verification round; the
    speed against the target alone is the speed curve's estimate (`Engine.speedup_estimate`), and says so."""
    stats = reply.stats
    against = "" if speedup is None else f"~{speedup:.1f}x the target alone (est. from the speed curve), "
    return (
        f"[{stats.tokens_per_s:.1f} tok/s, {against}{stats.tau:.2f} tokens/step, "
        f"{stats.accepted_per_step:.2f} drafts accepted/round ({stats.accepted} of {stats.verified} verified), "
        f"TTFT {(stats.ttft_s or 0) * 1e3:.0f} ms, {reply.completion_tokens} tokens, {reply.finish_reason}]"
    )


CODE_START = re.compile(r"\s*(def |class |import |from \S+ import |#include|function |fn |func |package |public )")


def looks_like_code(text: str) -> bool:
    """A prompt that reads as the start of a program, which a chat template would wrap as a question."""
    return bool(CODE_START.match(text)) or text.rstrip().endswith((":", "{", "(")) or "\n    " in text


def wants_colour(no_color: bool) -> bool:
    """Colour on a terminal unless --no-color or NO_COLOR (https://no-color.org) says otherwise."""
    import sys

    return not no_color and not os.environ.get("NO_COLOR") and sys.stdout.isatty()


def painted(delta: Delta, decode, colour: bool) -> str:
    """A delta's text, the tokens that came from accepted drafts in colour when `colour`."""
    if not colour or not any(delta.drafted):
        return delta.text
    return "".join(click.style(text, fg=DRAFT_COLOUR) if drafted else text for text, drafted in delta.spans(decode))


def banner(engine: Engine, params: SamplingParams, spec: str | None) -> str:
    """What a chat or server runs, as llama.cpp states it at start: model and weights, drafter, speculation mode,
    context and slots, and the sampling defaults a request gets."""
    m = engine.manifest
    drafter = f"drafter {m.drafter_name} (γ {m.gamma})" if m.drafter else "no drafter"
    if params.temperature == 0:
        sampling = "greedy"
    else:
        sampling = f"temperature {params.temperature:g}, top-p {params.top_p:g}" + \
            (f", top-k {params.top_k}" if params.top_k else "") + (f", min-p {params.min_p:g}" if params.min_p else "")
    return (f"{m.target_name} ({m.weights} weights), {drafter}, speculation {engine.speculation(spec)}; "
            f"context {m.max_context} tokens x {m.cache_slots} slot(s); sampling: {sampling} (--temp etc. change it)")


def readable_stats(reply: Completion | None) -> str:
    """/stats: the last reply's figures, one per line, rounded."""
    if reply is None:
        return "(no reply yet)"
    return "\n".join(f"{name:22s} {value:.3g}" if isinstance(value, float) else f"{name:22s} {value}"
                      for name, value in stats_json(reply).items())


def stats_json(reply: Completion | None) -> dict:
    """A reply's figures, its token count and finish reason, as `--json` and /stats print them."""
    if reply is None:
        return {}
    return asdict(reply.stats) | {"tokens": reply.completion_tokens, "finish_reason": reply.finish_reason}


CHAT_HELP = """/clear  forget the conversation
/stats  the last reply's figures
/help   this list
/exit   quit (also /quit, /bye, Ctrl+D)
Ctrl+C stops a reply; at an empty prompt it says how to quit."""


@main.command()
@engine_options
@click.option(
    "-p", "--prompt", default=None, help="Answer this once and exit (stdin is read when it is not a terminal)."
)
@click.option("--system", default=None, help="System prompt.")
@click.option(
    "--temp",
    "temperature",
    type=click.FloatRange(min=0),
    default=None,
    help="Temperature (0 = greedy; default: the model's).",
)
@click.option("--top-k", type=click.IntRange(min=0), default=None)
@click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=None)
@click.option("--min-p", type=click.FloatRange(min=0, max=1, max_open=True), default=None)
@click.option("--repeat-penalty", type=click.FloatRange(min=0, min_open=True), default=1.0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("-n", "--max-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option(
    "--ctx", type=click.IntRange(min=16), default=None, help="Tokens of history kept (default: the engine's context)."
)
@click.option(
    "--spec",
    default=None,
    help="off, fixed:K, sync or async (default: async once the engine is profiled, else fixed at γ).",
)
@click.option("--completion", is_flag=True, help="Plain text continuation, no chat template (base models).")
@click.option("--no-color", is_flag=True, help=f"Do not show accepted draft tokens in {DRAFT_COLOUR} (also NO_COLOR=1).")
@json_option
def chat(
    engine_dir,
    prompt,
    system,
    temperature,
    top_k,
    top_p,
    min_p,
    repeat_penalty,
    seed,
    max_tokens,
    stop,
    ctx,
    spec,
    completion,
    no_color,
    as_json,
    threads,
) -> None:
    """Interactive streaming chat (/clear, /stats, /exit; Ctrl+C stops a reply), or a one-shot answer.

    Tokens that came from accepted drafts are shown in colour on a terminal (--no-color, NO_COLOR=1 turn it off)."""
    import sys

    from dspark_runtime.chat import ChatSession

    if prompt is None and not sys.stdin.isatty():
        prompt = sys.stdin.read()
    with load_engine(engine_dir, threads) as engine:
        engine.speculation(spec)
        params = engine.default_params(max_tokens=max_tokens, seed=seed, stop=tuple(stop),
                                       repetition_penalty=repeat_penalty, temperature=temperature, top_k=top_k,
                                       top_p=top_p, min_p=min_p)
        session = ChatSession(engine, params, spec, system, ctx, completion)
        show = _Shown(engine, wants_colour(no_color))
        if prompt is not None:
            text = []
            for delta in _warned(session, session.send(prompt)):
                text.append(delta.text)
                if not as_json:
                    click.echo(show(delta), nl=False)
            if as_json:
                click.echo(json.dumps({"text": "".join(text), "finish_reason": session.last.finish_reason,
                                       "stats": stats_json(session.last)}))
            else:
                click.echo()
                click.echo(summary_line(session.last, engine.speedup_estimate(session.last.stats)), err=True)
                if not completion and engine.tokenizer.chat_template and looks_like_code(prompt):
                    click.echo("note: the prompt went to the model as a chat turn; --completion continues it as "
                               "written (code, base models)", err=True)
            return
        click.echo(banner(engine, params, spec), err=True)
        _repl(session, show, DEMO_PROMPT if engine.manifest.target_name == "demo" else None)


class _Shown:
    """How a delta is printed: its text, accepted drafts in colour when `colour`."""

    def __init__(self, engine: Engine, colour: bool):
        self.colour, self.engine = colour, engine

    def __call__(self, delta: Delta) -> str:
        return painted(delta, lambda ids: self.engine.tokenizer.decode(ids, skip_special_tokens=True), self.colour)


def _warned(session, deltas):
    """The reply's deltas, after a line on stderr when the prompt lost its beginning to fit the context."""
    for index, delta in enumerate(deltas):
        if index == 0 and session.dropped_tokens:
            click.echo(f"warning: the prompt's first {session.dropped_tokens} tokens were left out to fit the "
                       "context (--ctx and the engine's --max-context set it)", err=True)
        yield delta


def _repl(session, show: _Shown, suggestion: str | None) -> None:
    """The interactive chat; `suggestion` (the demo's prompt) is sent when the first line is empty."""
    if suggestion:
        click.echo(DEMO_INTRO.format(prompt=suggestion), err=True)
    click.echo("DSpark chat. /help lists the commands, /exit quits; Ctrl+C stops a reply."
               + (f" Accepted drafts are shown in {DRAFT_COLOUR}." if show.colour else ""), err=True)
    while True:
        try:
            line = input(">>> ")
            if not line.strip() and suggestion:
                line = suggestion
                click.echo(f"(sending the suggested prompt) {line}", err=True)
            suggestion = None
        except EOFError:
            click.echo()
            return
        except KeyboardInterrupt:
            click.echo("\n(Ctrl+D or /exit quits)", err=True)
            continue
        command = line.strip()
        if command in ("/exit", "/quit", "/bye"):
            return
        if command == "/clear":
            session.clear()
            click.echo("(conversation cleared)", err=True)
            continue
        if command == "/stats":
            click.echo(readable_stats(session.last), err=True)
            continue
        if command in ("/help", "/?"):
            click.echo(CHAT_HELP, err=True)
            continue
        if command.startswith("/") and " " not in command:
            click.echo(f"unknown command {command}; /help lists the commands", err=True)
            continue
        if not command:
            continue
        try:
            for delta in _warned(session, session.send(line)):
                click.echo(show(delta), nl=False)
        except KeyboardInterrupt:
            click.echo("\n(interrupted)", err=True)
        click.echo()
        if session.last:
            click.echo(summary_line(session.last, show.engine.speedup_estimate(session.last.stats)), err=True)


@main.command()
@engine_options
@prompt_options
@click.option("--modes", default="off,fixed:4", show_default=True, help="Comma-separated: off, fixed:K, sync, async.")
@click.option(
    "--concurrency",
    default="1",
    show_default=True,
    callback=int_list,
    help="Comma-separated request concurrency levels.",
)
@click.option("--max-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True)
@click.option("--ignore-eos", is_flag=True, help="Generate --max-tokens per prompt even past the end-of-text token.")
@click.option(
    "--rounds",
    "--repeats",
    "rounds",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Rounds of all modes in turn; figures are medians, ratios taken within each round (as `profile --rounds`).",
)
@click.option("--domains", default=None, help="Comma-separated prompt domains to keep (default: all).")
@click.option(
    "--plot", type=click.Path(dir_okay=False), default=None, help="PNG of the throughput vs per-request speed frontier."
)
@json_option
def bench(
    engine_dir,
    rows,
    modes,
    concurrency,
    max_tokens,
    temperature,
    ignore_eos,
    rounds,
    threads,
    domains,
    plot,
    as_json,
) -> None:
    """Throughput of each speculation mode against `off`, same prompts, one process.

    \b
    Example:
      dspark-run bench --modes off,fixed:2,fixed:4 --concurrency 1,4 --limit 10 --json
      dspark-run bench --modes off,fixed:7 --domains code --limit 10 --rounds 5
    """
    from dspark_runtime.bench import plot_frontier, run_benchmark
    from dspark_common.sampling import SamplingParams

    if domains:
        rows = [r for r in rows if r.get("domain") in domains.split(",")]
        if not rows:
            raise click.BadParameter(f"no prompt has a domain in {domains!r}", param_hint="--domains")
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=ignore_eos)

    def show(result: dict) -> None:
        if not as_json:
            click.echo(f"{result['mode']:>9} x{result['concurrency']:<3} {result['tokens_per_s']:8.1f} tok/s  "
                       f"tau {result['tau']:.2f}  per-request {result['per_request_tokens_per_s']:.1f} tok/s  "
                       f"step time: target {result['target_share_of_step_time']:.0%}, "
                       f"drafter {result['drafter_share_of_step_time']:.0%}", err=True)

    with load_engine(engine_dir, threads) as engine:
        report = run_benchmark(engine, rows, [m.strip() for m in modes.split(",")], concurrency, params, show, rounds)
    click.echo(json.dumps(report, indent=None if as_json else 2))
    if plot and not plot_frontier(report, plot):
        raise click.ClickException("--plot needs matplotlib: pip install 'dspark[export]' (the figures above stand)")


@main.command()
@engine_options
@click.option(
    "--context",
    type=click.IntRange(min=0),
    default=256,
    show_default=True,
    help="Cached positions per request while timing.",
)
@click.option("--rounds", type=click.IntRange(min=1), default=5, show_default=True,
              help="Interleaved rounds over all sizes; each size's figure is the median of its rounds.")
def profile(engine_dir, context, rounds, threads) -> None:
    """Measure target step time per batch size and drafter time per request count (hardware_curve.json).

    The `sync` and `async` modes schedule verification from these costs. Sizes are timed in interleaved rounds;
    a size whose rounds disagree by more than 25% is measured again, and the largest disagreement is printed (a note
    asks to profile again on a quiet machine where it stays above 25%).
    """
    from tqdm import tqdm

    from dspark_runtime.profiling import decode_tokens, target_sizes

    with load_engine(engine_dir, threads, profile=False) as engine:
        drafter_sizes = 2 * engine.manifest.cache_slots if engine.gamma else 0  # sampling and all-greedy tables
        total = len(target_sizes(decode_tokens(engine.manifest))) + drafter_sizes
        with tqdm(total=total, desc="profile", unit="size", disable=None) as bar:  # None: on a terminal only
            curve = engine.profile(context, rounds, lambda graph, n: bar.update())
    target, spread = curve["target_seconds"], curve["spread"]
    click.echo(f"target: {1e3 * target[0]:.2f} ms at 1 token, {1e3 * target[-1]:.2f} ms at {len(target)} tokens; "
               f"drafter: {1e3 * curve['draft_seconds'][0]:.2f} ms for 1 request sampling, "
               f"{1e3 * curve['greedy_draft_seconds'][0]:.2f} ms greedy; largest spread between rounds "
               f"{100 * spread['target']:.0f}% (target), {100 * spread['drafter']:.0f}% (drafter); "
               f"written to {engine.folder / 'hardware_curve.json'}")
    for note in profile_notes(curve, engine.manifest.weights, engine.exact_greedy):
        click.echo(f"note: {note}")


NOISY_SPREAD = 0.25  # rounds that still disagree by more than this after a second measurement: a busy machine
COSTLY_VERIFICATION = 2.0  # a block-quantized engine verifying 8 tokens at more than this many one-token steps


def profile_notes(curve: dict, weights: str = "fp32", paired: bool = False) -> list[str]:
    """What `profile` says beyond its figures: rounds timed on a busy machine, a CPU whose lone rows compute
    otherwise (and whether the engine, `paired`, runs every step in pairs), and a block-quantized engine whose
    verification costs many plain steps (w8a8's integer products would not)."""
    notes = []
    target = curve["target_seconds"]
    cost = target[min(7, len(target) - 1)] / target[0]
    if weights in ("int4", "int8") and cost > COSTLY_VERIFICATION:
        notes.append(f"verifying {min(8, len(target))} tokens costs {cost:.1f} one-token steps with {weights} "
                     "weights here: a `--weights w8a8` build verifies with integer products whose cost grows far "
                     "less with the tokens (1.3x at 8 with VNNI or AMX, about 2x on AVX2 alone; build it beside this "
                     "one and compare with `dspark-run bench`).")
    if max(curve["spread"].values()) > NOISY_SPREAD:
        notes.append(f"the rounds still disagreed by more than {NOISY_SPREAD:.0%} when measured again: the machine "
                     "was busy. `sync` and `async` decide from these costs; profile again on a quiet machine.")
    if curve["one_row_drift"]:
        drift = (f"on this CPU the target computes a token alone with other kernels than in a batch (logits differ by "
                 f"up to {curve['one_row_drift']:.1e}): ")
        pair = target[min(1, len(target) - 1)] / target[0]
        if paired:
            notes.append(drift + "this engine runs every step in pairs (w8a8, w4a8 and GGUF K-quant engines by "
                         "default, or --exact-greedy), so greedy output is the same in every mode (--no-exact-greedy "
                         f"runs a plain step alone, {pair:.2f}x cheaper here).")
        else:
            notes.append(drift + "greedy speculation can differ from `--spec off` where two tokens nearly tie; "
                         f"--exact-greedy makes every mode compute alike (a plain step then costs {pair:.2f}x, what a "
                         "two-token step does).")
    return notes


@main.command()
@engine_options
@prompt_options
@click.option("--max-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=1.0, show_default=True)
@click.option("--bias", is_flag=True, help="Also fit an offset per position (beyond the paper's STS; for greedy).")
@json_option
def calibrate(engine_dir, rows, max_tokens, temperature, threads, bias, as_json) -> None:
    """Fit Sequential Temperature Scaling on real verification rounds (calibration.json, calibration.png)."""
    from tqdm import tqdm

    from dspark_runtime.calibrate import calibrate as run_calibration
    from dspark_common.sampling import SamplingParams

    with load_engine(engine_dir, threads) as engine:
        with tqdm(total=len(rows), desc="calibrate", unit="prompt", disable=as_json or None) as bar:
            report = run_calibration(engine, rows, SamplingParams(max_tokens=max_tokens, temperature=temperature), True,
                                     bar.update, bias)
    if as_json:
        click.echo(json.dumps(report))
    else:
        for name in ("before", "after"):
            click.echo(
                f"{name:>6}: ECE {[round(100 * e, 2) for e in report[name]['ece']]} %  AUC {report[name]['auc']}"
            )
        click.echo(f"temperatures {report['temperatures']} fitted on {report['rounds_fit']} rounds; "
                   f"metrics on {report['rounds_held_out']} held-out rounds (odd-numbered prompts)")


@main.command()
@engine_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to listen on (localhost by default).")
@click.option("--port", type=click.IntRange(min=1, max=65535), default=8000, show_default=True)
@click.option("--spec", default=None, help="Default speculation mode for requests (a request may send `spec`).")
@click.option("--model-name", default=None, help="The model id clients see (default: the engine folder's name).")
@click.option("--allow-host", multiple=True, help="Another name clients may use in the Host header (repeatable).")
@click.option("--api-key", default=lambda: os.environ.get("DSPARK_API_KEY"),
              help="Require `Authorization: Bearer KEY` (default: $DSPARK_API_KEY; none).")
@click.option("--max-body", default="2MiB", show_default=True, help="Largest request body.")
def serve(engine_dir, host, port, spec, model_name, allow_host, api_key, max_body, threads) -> None:
    """OpenAI-compatible server: /v1/models, /v1/completions, /v1/chat/completions (stream: true for SSE), and a
    web chat at / (open http://127.0.0.1:8000/ in a browser).

    \b
    Example client:
      from openai import OpenAI
      client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
      client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}])
    """
    from dspark_runtime.server import ServerOptions, listening_socket, serve as run_server

    limit = parse_size(max_body, "--max-body")
    sock = listening_socket(host, port)
    with sock, load_engine(engine_dir, threads) as engine:
        click.echo(banner(engine, engine.default_params(), spec), err=True)
        options = ServerOptions(model_name or engine.folder.name, spec, host, tuple(allow_host), api_key, limit)
        shown = f"[{host}]" if ":" in host else host
        click.echo(f"web chat: http://{shown}:{port}/  (the OpenAI API under /v1)", err=True)
        run_server(engine, options, sock)


if __name__ == "__main__":
    main()
