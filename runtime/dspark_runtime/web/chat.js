"use strict";
// The DSpark web chat: streams /v1/chat/completions, marks the text that came from accepted drafts and draws each
// target step (accepted, rejected and unverified drafts, the target's own token). Model text only ever reaches
// the page as textContent.

const $ = (id) => document.getElementById(id);
const state = { model: null, messages: [], controller: null, key: sessionStorage.getItem("dspark-api-key") || "" };

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

async function loadInfo() {
  const info = await (await fetch("/health")).json();
  state.model = info.model;
  $("model").textContent = info.model;
  const modes = [["", "default"], ["off", "off (target alone)"]];
  if (info.profiled) modes.push(["async", "async (scheduled)"], ["sync", "sync (scheduled)"]);
  for (let k = 1; k <= (info.gamma || 0); k++) modes.push([`fixed:${k}`, `fixed:${k}`]);
  for (const [value, label] of modes) $("mode").append(new Option(label, value));
  $("temperature").value = info.temperature ?? 0;
  state.suggestion = info.suggested_prompt || null;
  if (state.suggestion) $("prompt").placeholder = `Try: ${state.suggestion} (Enter sends it)`;
  if (info.note) {
    $("note").textContent = info.note;
    $("note").hidden = false;
  }
}

function headers() {
  const result = { "Content-Type": "application/json" };
  if (state.key) result.Authorization = `Bearer ${state.key}`;
  return result;
}

function drawRounds(container, verifications) {
  for (const [proposed, verified, accepted] of verifications) {
    const row = element("div", "round");
    row.title = `drafted ${proposed}, verified ${verified}, accepted ${accepted}`;
    for (let i = 0; i < proposed; i++) {
      row.append(element("span", "cell " + (i < accepted ? "ok" : i < verified ? "no" : "skip")));
    }
    row.append(element("span", "cell target"));
    container.append(row);
  }
}

function statsLine(stats, speedup) {
  const speed = stats.tokens_per_s ? `${stats.tokens_per_s.toFixed(1)} tok/s` : "";
  const against = speedup ? ` (~${speedup.toFixed(1)}x the target alone, est. from the speed curve)` : "";
  return `${speed}${against} · ${stats.tau.toFixed(2)} tokens/step · ${stats.accepted} of ${stats.verified} ` +
    `verified drafts accepted (${stats.drafted} drafted) · TTFT ${Math.round((stats.ttft_s || 0) * 1000)} ms`;
}

async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const line = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      if (line.startsWith("data: ") && line !== "data: [DONE]") yield JSON.parse(line.slice(6));
    }
  }
}

async function send(text) {
  showError("");
  state.messages.push({ role: "user", content: text });
  $("conversation").append(element("div", "message user", text));
  const box = element("div", "message assistant");
  const reply = element("div", "reply");
  const rounds = element("div", "rounds");
  const stats = element("div", "stats");
  box.append(reply, rounds, stats);
  $("conversation").append(box);
  const body = { model: state.model, messages: state.messages, stream: true,
                 temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value) };
  if ($("mode").value) body.spec = $("mode").value;
  state.controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  let answer = "";
  try {
    const response = await fetch("/v1/chat/completions", { method: "POST", headers: headers(),
                                                           body: JSON.stringify(body), signal: state.controller.signal });
    if (response.status === 401) {
      $("key-label").hidden = false;
      throw new Error("this server needs its API key: enter it above and send again");
    }
    if (!response.ok) throw new Error((await response.json()).error.message);
    for await (const event of events(response)) {
      if (event.error) throw new Error(event.error.message);
      const extra = event.dspark || {};
      for (const [piece, drafted] of extra.spans || []) {
        reply.append(drafted ? element("span", "draft", piece) : document.createTextNode(piece));
        answer += piece;
      }
      drawRounds(rounds, extra.verifications || []);
      if (extra.stats) stats.textContent = statsLine(extra.stats, extra.speedup_estimate);
      box.scrollIntoView({ block: "end" });
    }
  } catch (error) {
    if (error.name === "AbortError") stats.textContent = "(stopped)";
    else showError(error.message);
  } finally {
    state.messages.push({ role: "assistant", content: answer });
    state.controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

function start() {
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value.trim() || (state.messages.length ? "" : state.suggestion || "");
    if (!text || state.controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("clear").addEventListener("click", () => {
    if (state.controller) state.controller.abort();
    state.messages = [];
    $("conversation").replaceChildren();
  });
  $("api-key").addEventListener("change", () => {
    state.key = $("api-key").value;
    sessionStorage.setItem("dspark-api-key", state.key);
  });
  loadInfo().catch((error) => showError(`cannot reach the server: ${error.message}`));
}

start();
