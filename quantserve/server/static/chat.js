// The chat page: conversations in localStorage, replies streamed from /v1/chat/completions.
// What a model or a user wrote is only ever put in the page as text (textContent, createTextNode), never
// parsed as HTML: model output is text. The server's Content-Security-Policy backs this up.
"use strict";

const KEYS = {
  conversations: "quantserve.conversations",
  current: "quantserve.current",
  settings: "quantserve.settings",
  apiKey: "quantserve.apiKey",
};
const DEFAULT_SYSTEM = "You are a helpful assistant.";
// Blank temperature / top-p: the model's own defaults (models.toml's [sampling]) apply on the server.
const DEFAULT_SETTINGS = { model: "", temperature: "", top_p: "", max_tokens: "1024" };
const UNTITLED = "New chat";

const state = {
  conversations: [], // most recently used first
  currentId: null,
  settings: { ...DEFAULT_SETTINGS },
  apiKey: "",
  renaming: null, // id of the conversation whose name is being edited
  confirmDelete: null, // id of the conversation whose Delete was clicked once
  controller: null, // AbortController of the request in flight
  streaming: null, // {conv, reply}: where the request in flight writes
  pendingBody: null, // the element showing the reply in flight
  drawQueued: false,
  lastSave: 0,
};

const $ = (id) => document.getElementById(id);

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function newId() {
  // crypto.randomUUID needs a secure context; a server reached over plain http on a LAN address is not one.
  return Date.now().toString(36) + Math.random().toString(36).slice(2, 10);
}

// ---- storage -------------------------------------------------------------------------------------

function loadJSON(key, fallback) {
  try {
    const raw = localStorage.getItem(key);
    return raw === null ? fallback : JSON.parse(raw);
  } catch (e) {
    console.warn(`ignoring unreadable ${key} in localStorage`, e);
    return fallback;
  }
}

function saveJSON(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
  } catch (e) {
    showError(`Could not save to localStorage: ${e.message}`);
  }
}

function normalizeConversations(raw) {
  if (!Array.isArray(raw)) return [];
  const out = [];
  for (const c of raw) {
    if (!c || typeof c !== "object") continue;
    const messages = Array.isArray(c.messages)
      ? c.messages.filter((m) => m && (m.role === "user" || m.role === "assistant"))
      : [];
    out.push({
      id: String(c.id || newId()),
      title: String(c.title || UNTITLED),
      system: typeof c.system === "string" ? c.system : "",
      messages,
      updated: Number(c.updated) || 0,
    });
  }
  return out;
}

function save() {
  saveJSON(KEYS.conversations, state.conversations);
  saveJSON(KEYS.current, state.currentId);
  state.lastSave = Date.now();
}

function saveSettings() {
  saveJSON(KEYS.settings, state.settings);
}

// ---- conversations -------------------------------------------------------------------------------

function current() {
  return state.conversations.find((c) => c.id === state.currentId);
}

function createConversation() {
  const prev = current();
  const conv = {
    id: newId(),
    title: UNTITLED,
    system: prev ? prev.system : DEFAULT_SYSTEM,
    messages: [],
    updated: Date.now(),
  };
  state.conversations.unshift(conv);
  return conv;
}

function newChat() {
  const conv = current();
  if (!conv || conv.messages.length > 0) select(createConversation().id);
  $("input").focus();
}

function select(id) {
  state.currentId = id;
  state.renaming = null;
  state.confirmDelete = null;
  save();
  renderSidebar();
  renderMessages();
  $("system").value = current().system;
}

function rename(conv, title) {
  if (state.renaming !== conv.id) return; // Enter and the blur that follows both end an edit
  state.renaming = null;
  const name = title.trim();
  if (name) conv.title = name.slice(0, 200);
  save();
  renderSidebar();
}

function remove(conv) {
  if (state.streaming && state.streaming.conv === conv) state.controller.abort();
  state.conversations = state.conversations.filter((c) => c !== conv);
  if (state.conversations.length === 0) createConversation();
  state.confirmDelete = null;
  if (!current()) state.currentId = state.conversations[0].id;
  select(state.currentId);
}

function titleFrom(text) {
  const line = text.trim().split("\n")[0];
  return line.length > 40 ? `${line.slice(0, 40)}…` : line;
}

// ---- rendering -----------------------------------------------------------------------------------

function renderSidebar() {
  const list = $("conversations");
  list.replaceChildren();
  let editor = null;
  for (const conv of state.conversations) {
    const li = el("li");
    if (conv.id === state.currentId) li.classList.add("current");
    if (state.renaming === conv.id) {
      editor = el("input");
      editor.value = conv.title;
      editor.setAttribute("aria-label", "Conversation name");
      editor.addEventListener("keydown", (e) => {
        if (e.key === "Enter") {
          e.preventDefault();
          rename(conv, editor.value);
        } else if (e.key === "Escape") {
          state.renaming = null;
          renderSidebar();
        }
      });
      editor.addEventListener("blur", () => rename(conv, editor.value));
      li.append(editor);
    } else {
      const title = el("button", "title", conv.title);
      title.type = "button";
      title.title = conv.title;
      title.addEventListener("click", () => select(conv.id));
      const ren = el("button", "small rename", "✎");
      ren.type = "button";
      ren.title = "Rename";
      ren.setAttribute("aria-label", "Rename");
      ren.addEventListener("click", () => {
        state.renaming = conv.id;
        renderSidebar();
      });
      const confirming = state.confirmDelete === conv.id;
      const del = el("button", confirming ? "small delete confirm" : "small delete", confirming ? "Delete?" : "✕");
      del.type = "button";
      del.title = confirming ? "Click again to delete" : "Delete";
      del.setAttribute("aria-label", del.title);
      del.addEventListener("click", () => {
        if (state.confirmDelete === conv.id) return remove(conv);
        state.confirmDelete = conv.id;
        renderSidebar();
        setTimeout(() => {
          if (state.confirmDelete === conv.id) {
            state.confirmDelete = null;
            renderSidebar();
          }
        }, 3000);
      });
      li.append(title, ren, del);
    }
    list.append(li);
  }
  if (editor) {
    editor.focus();
    editor.select();
  }
}

function renderMessages() {
  const box = $("messages");
  box.replaceChildren();
  state.pendingBody = null;
  const conv = current();
  if (!conv || conv.messages.length === 0) {
    box.append(el("div", "empty", "Ask something to start."));
    return;
  }
  for (const m of conv.messages) box.append(messageNode(m));
  box.scrollTop = box.scrollHeight;
}

function messageNode(m) {
  const node = el("div", `msg ${m.role}`);
  node.append(el("div", "role", m.role === "user" ? "You" : m.model || "Assistant"));
  const body = el("div", "body");
  fillBody(body, m);
  node.append(body);
  if (m.note) node.append(el("div", "note", m.note));
  if (state.streaming && state.streaming.reply === m) {
    node.classList.add("pending");
    state.pendingBody = body;
  }
  return node;
}

function fillBody(body, m) {
  if (typeof m.reasoning === "string" && m.reasoning) body.append(thinkingNode(m));
  const content = m.content;
  if (Array.isArray(content)) {
    // OpenAI content parts: text, and image_url for a vision model. The page cannot attach images yet; a
    // stored conversation that has them shows them here.
    for (const part of content) {
      if (part && part.type === "text") appendText(body, String(part.text ?? ""));
      else if (part && part.type === "image_url") appendImage(body, part.image_url);
    }
  } else {
    appendText(body, String(content ?? ""));
  }
  for (const call of Array.isArray(m.tool_calls) ? m.tool_calls : []) {
    if (call) body.append(toolCallNode(call));
  }
}

// A thinking model's reasoning: collapsed above the answer (open it to read), as text. While it streams and no
// answer has come yet, the summary says so.
function thinkingNode(m) {
  const node = el("details", "thinking");
  const still = state.streaming && state.streaming.reply === m && !m.content;
  node.append(el("summary", "", still ? "Thinking…" : "Thought"));
  node.open = Boolean(m.thinkingOpen);
  node.addEventListener("toggle", () => {
    m.thinkingOpen = node.open;
  });
  appendText(node, m.reasoning);
  return node;
}

// Prose as text (with `inline code`), ``` fenced blocks as <pre><code>. An unclosed fence (a reply still
// streaming) is code up to the end.
function appendText(parent, text) {
  let prose = [];
  let code = null; // {lang, lines}
  const flushProse = () => {
    const chunk = prose.join("\n").replace(/^\n+|\n+$/g, "");
    if (chunk) appendInline(parent, chunk);
    prose = [];
  };
  for (const line of text.split("\n")) {
    if (code) {
      if (/^\s*```\s*$/.test(line)) {
        parent.append(codeBlock(code));
        code = null;
      } else {
        code.lines.push(line);
      }
    } else {
      const fence = /^\s*```\s*([^\s`]*)/.exec(line);
      if (fence) {
        flushProse();
        code = { lang: fence[1], lines: [] };
      } else {
        prose.push(line);
      }
    }
  }
  flushProse();
  if (code) parent.append(codeBlock(code));
}

function appendInline(parent, text) {
  const block = el("div", "text");
  text.split(/`([^`\n]+)`/).forEach((part, i) => {
    if (part) block.append(i % 2 ? el("code", "", part) : document.createTextNode(part));
  });
  parent.append(block);
}

function codeBlock({ lang, lines }) {
  const pre = el("pre");
  if (lang) pre.dataset.lang = lang;
  pre.append(el("code", "", lines.join("\n")));
  return pre;
}

function appendImage(parent, imageUrl) {
  const url = String((imageUrl && imageUrl.url) || imageUrl || "");
  if (/^(data:image\/|blob:)/.test(url)) {
    const img = el("img", "image");
    img.alt = "image";
    img.src = url;
    parent.append(img);
  } else {
    parent.append(el("div", "image-ref", `[image: ${url.slice(0, 120)}]`));
  }
}

function toolCallNode(call) {
  const fn = call.function || {};
  const box = el("div", "tool-call");
  box.append(el("span", "label", "Tool call "), el("span", "name", String(fn.name || "(unnamed)")));
  let args = String(fn.arguments ?? "");
  try {
    args = JSON.stringify(JSON.parse(args), null, 2);
  } catch {
    // still streaming, or not JSON: shown as it came
  }
  const pre = el("pre");
  pre.append(el("code", "", args));
  box.append(pre);
  return box;
}

// Redraw only the reply in flight, once per frame however many tokens arrived.
function drawPending() {
  if (state.drawQueued) return;
  state.drawQueued = true;
  requestAnimationFrame(() => {
    state.drawQueued = false;
    const body = state.pendingBody;
    if (!body || !body.isConnected || !state.streaming) return;
    const box = $("messages");
    const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
    body.replaceChildren();
    fillBody(body, state.streaming.reply);
    if (atBottom) box.scrollTop = box.scrollHeight;
  });
  if (Date.now() - state.lastSave > 1000) save(); // a reload mid-reply keeps most of it
}

function showError(message) {
  $("error-text").textContent = message;
  $("error").hidden = false;
}

function hideError() {
  $("error").hidden = true;
}

function setStatus(text) {
  $("status").textContent = text;
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

function openSettings(open) {
  $("settings").hidden = !open;
  $("settings-toggle").setAttribute("aria-expanded", String(open));
}

// ---- the API -------------------------------------------------------------------------------------

function headers() {
  const h = { "Content-Type": "application/json" };
  if (state.apiKey) h.Authorization = `Bearer ${state.apiKey}`;
  return h;
}

// The message of an OpenAI error object ({"error": {"message": ...}}), or the HTTP status.
async function apiError(res) {
  let message = `${res.status} ${res.statusText}`;
  try {
    const body = await res.json();
    if (body && body.error && body.error.message) message = String(body.error.message);
  } catch {
    // not JSON: the status says enough
  }
  return { status: res.status, message };
}

function askForKey(message) {
  openSettings(true);
  $("api-key").focus();
  setStatus("API key needed");
  showError(`This server needs an API key: enter it in Settings → API key. (${message})`);
}

async function loadModels() {
  setStatus("Loading the model list…");
  let res;
  try {
    res = await fetch("/v1/models", { headers: headers() });
  } catch (e) {
    setStatus("");
    showError(`Cannot reach the server: ${e.message}`);
    return;
  }
  if (res.status === 401) return askForKey((await apiError(res)).message);
  if (res.status === 503) {
    setStatus(`${(await apiError(res)).message}; retrying…`);
    setTimeout(loadModels, 2000);
    return;
  }
  if (!res.ok) {
    setStatus("");
    showError(`Could not list the models: ${(await apiError(res)).message}`);
    return;
  }
  const body = await res.json();
  const models = Array.isArray(body.data) ? body.data : [];
  const select = $("model");
  select.replaceChildren();
  for (const m of models) {
    const id = String(m.id);
    const status = m.status && m.status !== "loaded" ? ` (${m.status})` : "";
    const option = el("option", "", id + status);
    option.value = id;
    if (m.context_length) option.title = `context: ${m.context_length} tokens`;
    select.append(option);
  }
  if (models.some((m) => String(m.id) === state.settings.model)) select.value = state.settings.model;
  setStatus(models.length ? "" : "The server lists no models.");
  if ($("error-text").textContent.startsWith("This server needs an API key")) hideError();
}

function requestMessages(conv, reply) {
  const out = [];
  if (conv.system.trim()) out.push({ role: "system", content: conv.system });
  for (const m of conv.messages) {
    if (m === reply) continue;
    // Tool calls stay on the page only: sent back, they would need the tool results that follow them.
    if (m.role === "assistant" && !String(m.content ?? "")) continue;
    const message = { role: m.role, content: m.content };
    // earlier reasoning goes back; the model's template keeps what its family keeps
    if (m.role === "assistant" && typeof m.reasoning === "string" && m.reasoning) message.reasoning_content = m.reasoning;
    out.push(message);
  }
  return out;
}

function samplingFields() {
  const fields = {};
  for (const key of ["temperature", "top_p", "max_tokens"]) {
    const value = String(state.settings[key] ?? "").trim();
    if (value !== "") fields[key] = Number(value); // a bad value gets the server's 400, which says why
  }
  return fields;
}

// Server-sent events: `data:` lines, one event per blank line; `[DONE]` ends the stream.
async function readEvents(res, onData) {
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let data = [];
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    const lines = buffer.split(/\r?\n/);
    buffer = lines.pop();
    for (const line of lines) {
      if (line === "") {
        if (data.length === 0) continue;
        const payload = data.join("\n");
        data = [];
        if (payload === "[DONE]") {
          reader.cancel().catch(() => {});
          return;
        }
        onData(JSON.parse(payload));
      } else if (line.startsWith("data:")) {
        data.push(line.slice(5).replace(/^ /, ""));
      }
    }
  }
}

function takeChunk(reply, chunk, stats) {
  if (chunk.error) throw new Error(String(chunk.error.message || "the server reported an error"));
  if (chunk.usage) stats.tokens = chunk.usage.completion_tokens;
  const choice = Array.isArray(chunk.choices) ? chunk.choices[0] : null;
  if (!choice) return;
  const delta = choice.delta || {};
  if (typeof delta.content === "string") reply.content += delta.content;
  if (typeof delta.reasoning_content === "string") reply.reasoning = (reply.reasoning || "") + delta.reasoning_content;
  if (Array.isArray(delta.tool_calls)) {
    reply.tool_calls = reply.tool_calls || [];
    for (const d of delta.tool_calls) {
      const i = Number.isInteger(d.index) && d.index >= 0 && d.index < 64 ? d.index : reply.tool_calls.length;
      const fn = d.function || {};
      const call = (reply.tool_calls[i] ||= { id: "", type: "function", function: { name: "", arguments: "" } });
      if (d.id) call.id = String(d.id);
      if (fn.name) call.function.name = String(fn.name);
      if (fn.arguments) call.function.arguments += String(fn.arguments);
    }
  }
  if (choice.finish_reason === "length") reply.note = "cut off at max tokens";
}

async function send() {
  if (state.controller) return;
  const input = $("input");
  const text = input.value;
  if (!text.trim()) return;
  const model = $("model").value;
  if (!model) {
    showError("There is no model to send to yet (see the model list above).");
    return;
  }
  hideError();
  const conv = current();
  const question = { role: "user", content: text };
  const reply = { role: "assistant", content: "", model };
  conv.messages.push(question, reply);
  if (conv.title === UNTITLED) conv.title = titleFrom(text);
  conv.updated = Date.now();
  state.conversations = [conv, ...state.conversations.filter((c) => c !== conv)];
  input.value = "";

  const controller = new AbortController();
  state.controller = controller;
  state.streaming = { conv, reply };
  setBusy(true);
  setStatus("Generating…");
  save();
  renderSidebar();
  renderMessages();

  const body = {
    model,
    messages: requestMessages(conv, reply),
    stream: true,
    stream_options: { include_usage: true },
    ...samplingFields(),
  };
  const stats = { tokens: null, t0: performance.now() };
  let failure = null;
  try {
    const res = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers(),
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!res.ok) {
      failure = await apiError(res);
    } else {
      await readEvents(res, (chunk) => {
        takeChunk(reply, chunk, stats);
        drawPending();
      });
    }
  } catch (e) {
    if (e.name === "AbortError") reply.note = "stopped";
    else failure = { status: 0, message: e.message };
  } finally {
    state.controller = null;
    state.streaming = null;
    setBusy(false);
  }

  const empty = !reply.content && !reply.reasoning && !(reply.tool_calls && reply.tool_calls.length);
  if (failure && empty) {
    // Nothing came back: the question returns to the composer, to be sent again once fixed.
    conv.messages = conv.messages.filter((m) => m !== question && m !== reply);
    if (!input.value) input.value = text;
  } else if (failure) {
    reply.note = `error: ${failure.message}`;
  }
  if (failure && failure.status === 401) askForKey(failure.message);
  else if (failure) showError(failure.message);
  const secs = (performance.now() - stats.t0) / 1000;
  setStatus(stats.tokens ? `${stats.tokens} tokens in ${secs.toFixed(1)} s` : "");
  save();
  if (conv === current()) renderMessages();
}

// ---- wiring --------------------------------------------------------------------------------------

function bindSetting(id, key) {
  const input = $(id);
  input.value = state.settings[key];
  input.addEventListener("change", () => {
    state.settings[key] = input.value.trim();
    saveSettings();
  });
}

function init() {
  state.conversations = normalizeConversations(loadJSON(KEYS.conversations, []));
  const saved = loadJSON(KEYS.settings, {});
  state.settings = { ...DEFAULT_SETTINGS, ...(saved && typeof saved === "object" ? saved : {}) };
  state.apiKey = String(loadJSON(KEYS.apiKey, "") || "");
  state.currentId = loadJSON(KEYS.current, null);
  if (state.conversations.length === 0) createConversation();
  if (!current()) state.currentId = state.conversations[0].id;
  select(state.currentId);

  bindSetting("temperature", "temperature");
  bindSetting("top-p", "top_p");
  bindSetting("max-tokens", "max_tokens");
  const key = $("api-key");
  key.value = state.apiKey;
  key.addEventListener("change", () => {
    state.apiKey = key.value.trim();
    if (state.apiKey) saveJSON(KEYS.apiKey, state.apiKey);
    else localStorage.removeItem(KEYS.apiKey);
    loadModels();
  });
  $("system").addEventListener("input", () => {
    current().system = $("system").value;
    save();
  });
  $("model").addEventListener("change", () => {
    state.settings.model = $("model").value;
    saveSettings();
  });
  $("settings-toggle").addEventListener("click", () => openSettings($("settings").hidden));
  $("new-chat").addEventListener("click", newChat);
  $("error-close").addEventListener("click", hideError);
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    } else if (e.key === "Escape" && state.controller) {
      state.controller.abort();
    }
  });
  loadModels();
  $("input").focus();
}

init();
