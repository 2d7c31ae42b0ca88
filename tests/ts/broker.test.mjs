// End-to-end tests of sandbox-broker through the official MCP TypeScript SDK.
//
// Run by tests/ts_sdk_test.go (go test -run TestTypeScriptSDK ./tests/),
// which starts a fresh broker and passes:
//
//   BROKER_URL         http://127.0.0.1:PORT (the MCP endpoint is /mcp)
//   BROKER_TOKEN       pro principal "ts-pro"; only the get_usage test calls tools with it
//   BROKER_AUX_TOKEN   pro principal "ts-pro-aux"; for tests that need a working client
//   BROKER_FREE_TOKEN  free principal "ts-free"; only the rate-limit test uses it
//   BROKER_STREAM_TOKEN pro principal "ts-stream"; the streaming test (2 calls)
//   BROKER_FILES_TOKEN pro principal "ts-files"; the file resource test (2 calls)
//   BROKER_FILES_OTHER_TOKEN pro principal "ts-files-other"; reads ts-files's file (1 call)
//   BROKER_BUILD_TOKEN pro principal "ts-build"; the slow project build test (at most 5 calls)
//   BROKER_BUILD_WAIT_S the broker's PROJECT_BUILD_WAIT_S
//   BROKER_RATE_LIMIT  the broker's RATE_LIMIT_PER_MINUTE
//
// RATE_LIMIT_PER_MINUTE applies to every principal, so each principal's tool
// calls are budgeted: ts-pro makes 1, ts-pro-aux at most 2, ts-free exactly
// limit+2 (all in the rate-limit test). Tests share no principal whose counter
// they assert on, so they pass in any order.

import { test } from 'node:test';
import assert from 'node:assert/strict';

import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import {
  StreamableHTTPClientTransport,
  StreamableHTTPError,
} from '@modelcontextprotocol/sdk/client/streamableHttp.js';
import { ErrorCode, LoggingMessageNotificationSchema, McpError } from '@modelcontextprotocol/sdk/types.js';

function requireEnv(name) {
  const v = process.env[name];
  if (!v) {
    throw new Error(`${name} is not set; run these tests through "go test -run TestTypeScriptSDK ./tests/"`);
  }
  return v;
}

const BASE_URL = requireEnv('BROKER_URL').replace(/\/+$/, '');
const MCP_URL = new URL(`${BASE_URL}/mcp`);
const PRO_TOKEN = requireEnv('BROKER_TOKEN');
const AUX_TOKEN = requireEnv('BROKER_AUX_TOKEN');
const FREE_TOKEN = requireEnv('BROKER_FREE_TOKEN');
const STREAM_TOKEN = requireEnv('BROKER_STREAM_TOKEN');
const FILES_TOKEN = requireEnv('BROKER_FILES_TOKEN');
const FILES_OTHER_TOKEN = requireEnv('BROKER_FILES_OTHER_TOKEN');
const BUILD_TOKEN = requireEnv('BROKER_BUILD_TOKEN');
const BUILD_WAIT_S = Number.parseInt(requireEnv('BROKER_BUILD_WAIT_S'), 10);
const RATE_LIMIT = Number.parseInt(requireEnv('BROKER_RATE_LIMIT'), 10);
if (!Number.isInteger(RATE_LIMIT) || RATE_LIMIT < 1 || RATE_LIMIT > 50) {
  throw new Error(`BROKER_RATE_LIMIT must be a small positive integer, got ${process.env.BROKER_RATE_LIMIT}`);
}

const TEST_TIMEOUT_MS = 30_000;

function newTransport(headers) {
  return new StreamableHTTPClientTransport(MCP_URL, { requestInit: { headers } });
}

// connect returns an initialised client; close it with closeClient.
async function connect(token, name = 'sandbox-broker-ts-tests') {
  const client = new Client({ name, version: '1.0.0' });
  const transport = newTransport({ Authorization: `Bearer ${token}` });
  await client.connect(transport);
  assert.ok(transport.sessionId, 'the broker runs stateful sessions, so initialize must return Mcp-Session-Id');
  return { client, transport };
}

// closeClient ends the session (HTTP DELETE) and closes the client.
async function closeClient({ client, transport }) {
  try {
    if (transport.sessionId) {
      await transport.terminateSession();
    }
  } finally {
    await client.close();
  }
}

// withClient runs fn with a fresh client for token and always closes it.
async function withClient(token, fn) {
  const c = await connect(token);
  try {
    return await fn(c.client, c.transport);
  } finally {
    await closeClient(c);
  }
}

// callOk calls a tool and asserts it succeeded with matching text and
// structured content; it returns the structured content.
async function callOk(client, name, args = {}) {
  const res = await client.callTool({ name, arguments: args });
  assert.notEqual(res.isError, true, `${name} failed: ${JSON.stringify(res)}`);
  return structured(res);
}

// structured checks that the text content and structuredContent of a tool
// result carry the same JSON object, and returns it.
function structured(res) {
  assert.ok(Array.isArray(res.content) && res.content.length >= 1, `result has no content: ${JSON.stringify(res)}`);
  assert.equal(res.content[0].type, 'text', `first content is not text: ${JSON.stringify(res.content[0])}`);
  let fromText;
  try {
    fromText = JSON.parse(res.content[0].text);
  } catch (err) {
    assert.fail(`text content is not JSON (${err.message}): ${res.content[0].text}`);
  }
  assert.ok(res.structuredContent && typeof res.structuredContent === 'object',
    `result has no structuredContent: ${JSON.stringify(res)}`);
  assert.deepEqual(res.structuredContent, fromText, 'structuredContent and text content disagree');
  return res.structuredContent;
}

// rawPost sends an initialize request without the SDK, so the test sees the
// raw HTTP status and headers.
async function rawPost(headers) {
  return fetch(MCP_URL, {
    method: 'POST',
    headers: {
      'Content-Type': 'application/json',
      Accept: 'application/json, text/event-stream',
      ...headers,
    },
    body: JSON.stringify({
      jsonrpc: '2.0',
      id: 1,
      method: 'initialize',
      params: {
        protocolVersion: '2025-06-18',
        capabilities: {},
        clientInfo: { name: 'raw-fetch', version: '1.0.0' },
      },
    }),
    signal: AbortSignal.timeout(10_000),
  });
}

// assertUnauthorized checks a raw 401 response: challenge and JSON body.
async function assertUnauthorized(res, { invalidToken }) {
  const body = await res.text();
  assert.equal(res.status, 401, `want 401, got ${res.status}: ${body}`);
  const challenge = res.headers.get('www-authenticate');
  assert.ok(challenge, 'a 401 must carry WWW-Authenticate');
  assert.match(challenge, /^Bearer\b/, `challenge ${challenge}`);
  assert.match(challenge, /realm="sandbox-broker"/, `challenge ${challenge}`);
  if (invalidToken) {
    assert.match(challenge, /error="invalid_token"/, `a presented but wrong token should say invalid_token: ${challenge}`);
  } else {
    assert.doesNotMatch(challenge, /error=/, `no token presented, so no error code is expected: ${challenge}`);
  }
  assert.equal(res.headers.get('mcp-session-id'), null, 'an unauthenticated request must not get a session');
  const parsed = JSON.parse(body);
  assert.equal(parsed.error, 'UNAUTHENTICATED', body);
}

// assertConnectRejected checks that the SDK refuses to connect with 401.
async function assertConnectRejected(headers) {
  const client = new Client({ name: 'sandbox-broker-ts-tests-unauth', version: '1.0.0' });
  const transport = newTransport(headers);
  try {
    await assert.rejects(client.connect(transport), (err) => {
      assert.ok(err instanceof StreamableHTTPError, `want StreamableHTTPError, got ${err?.constructor?.name}: ${err?.message}`);
      assert.equal(err.code, 401, `want HTTP 401, got ${err.code}: ${err.message}`);
      return true;
    });
    assert.equal(transport.sessionId, undefined, 'a rejected client must not hold a session');
  } finally {
    await client.close();
  }
}

test('initialize reports sandbox-broker and tools/list describes get_usage', { timeout: TEST_TIMEOUT_MS }, async () => {
  await withClient(AUX_TOKEN, async (client) => {
    const info = client.getServerVersion();
    assert.ok(info, 'no serverInfo after initialize');
    assert.equal(info.name, 'sandbox-broker');
    assert.equal(typeof info.version, 'string');
    assert.ok(info.version.length > 0, 'serverInfo.version is empty');

    const caps = client.getServerCapabilities();
    assert.ok(caps?.tools, `server does not advertise tools: ${JSON.stringify(caps)}`);
    assert.ok(caps?.resources, `server does not advertise resources: ${JSON.stringify(caps)}`);

    const { tools } = await client.listTools();
    const names = tools.map((t) => t.name);
    assert.equal(new Set(names).size, names.length, `duplicate tool names: ${names}`);
    const usage = tools.find((t) => t.name === 'get_usage');
    assert.ok(usage, `get_usage missing from tools/list: ${names}`);
    assert.ok(usage.description && usage.description.length > 0, 'get_usage has no description');
    assert.equal(usage.inputSchema.type, 'object');
    assert.equal(usage.inputSchema.additionalProperties, false, `inputSchema: ${JSON.stringify(usage.inputSchema)}`);
    assert.deepEqual(usage.inputSchema.properties ?? {}, {}, 'get_usage takes no arguments');
    assert.equal(usage.annotations?.readOnlyHint, true, `annotations: ${JSON.stringify(usage.annotations)}`);
    assert.equal(usage.annotations?.destructiveHint, false, `annotations: ${JSON.stringify(usage.annotations)}`);
  });
});

test('get_usage reports the pro principal, its tier and limits', { timeout: TEST_TIMEOUT_MS }, async () => {
  await withClient(PRO_TOKEN, async (client) => {
    const u = await callOk(client, 'get_usage');
    assert.equal(u.principal, 'ts-pro');
    assert.equal(u.tier, 'pro');
    assert.deepEqual(u.limits, {
      calls_per_minute: RATE_LIMIT, // RATE_LIMIT_PER_MINUTE overrides every tier
      sandboxes_per_hour: 100,
      execution_seconds_per_day: 86400,
    });
    // This is ts-pro's only call, and it counts itself.
    assert.deepEqual(u.used, { calls_this_minute: 1, sandboxes_this_hour: 0, execution_seconds_today: 0 });
    assert.deepEqual(u.remaining, {
      calls_this_minute: RATE_LIMIT - 1,
      sandboxes_this_hour: 100,
      execution_seconds_today: 86400,
    });
  });
});

test('no token: the SDK cannot connect and a raw POST gets 401 with a Bearer challenge', { timeout: TEST_TIMEOUT_MS }, async () => {
  await assertConnectRejected({});
  await assertUnauthorized(await rawPost({}), { invalidToken: false });
  // A non-Bearer scheme is the same as no token.
  await assertUnauthorized(await rawPost({ Authorization: `Basic ${Buffer.from('ts-pro:x').toString('base64')}` }), { invalidToken: false });
});

test('a wrong token gets 401 too', { timeout: TEST_TIMEOUT_MS }, async () => {
  const wrong = `${PRO_TOKEN}x`;
  await assertConnectRejected({ Authorization: `Bearer ${wrong}` });
  await assertUnauthorized(await rawPost({ Authorization: `Bearer ${wrong}` }), { invalidToken: true });
  await assertUnauthorized(await rawPost({ Authorization: 'Bearer not-a-configured-token-0123456789' }), { invalidToken: true });
});

test('the free token is rate limited after exactly BROKER_RATE_LIMIT calls', { timeout: TEST_TIMEOUT_MS }, async () => {
  let successes = 0;
  let limited;
  await withClient(FREE_TOKEN, async (client) => {
    // Call until refused, but never more than limit+1 times.
    for (let i = 0; i <= RATE_LIMIT; i++) {
      const res = await client.callTool({ name: 'get_usage', arguments: {} });
      if (res.isError) {
        limited = res;
        break;
      }
      const u = structured(res);
      successes++;
      assert.equal(u.principal, 'ts-free');
      assert.equal(u.tier, 'free');
      assert.deepEqual(u.limits, {
        calls_per_minute: RATE_LIMIT,
        sandboxes_per_hour: 5,
        execution_seconds_per_day: 3600,
      });
      assert.equal(u.used.calls_this_minute, successes, `call ${successes}: used ${JSON.stringify(u.used)}`);
      assert.equal(u.remaining.calls_this_minute, RATE_LIMIT - successes,
        `call ${successes}: remaining ${JSON.stringify(u.remaining)}`);
    }
    assert.equal(successes, RATE_LIMIT, `want exactly ${RATE_LIMIT} successful calls before the limit, got ${successes}`);
    assert.ok(limited, `call ${RATE_LIMIT + 1} was not refused`);
    assertRateLimited(limited);
  });

  // The limit belongs to the principal, not the session: a new session is
  // still refused.
  await withClient(FREE_TOKEN, async (client) => {
    assertRateLimited(await client.callTool({ name: 'get_usage', arguments: {} }));
  });

  // Other principals are unaffected.
  await withClient(AUX_TOKEN, async (client) => {
    const u = await callOk(client, 'get_usage');
    assert.equal(u.principal, 'ts-pro-aux');
  });
});

function assertRateLimited(res) {
  assert.equal(res.isError, true, `want a rate-limit error, got ${JSON.stringify(res)}`);
  const e = structured(res);
  assert.equal(e.error, 'RATE_LIMIT_EXCEEDED', JSON.stringify(e));
  assert.equal(e.retryable, true, JSON.stringify(e));
  assert.ok(Number.isInteger(e.retry_after_s), `retry_after_s must be an integer: ${JSON.stringify(e)}`);
  assert.ok(e.retry_after_s >= 1, `retry_after_s must be >= 1: ${JSON.stringify(e)}`);
  // A sliding one-minute window never needs more than two minutes.
  assert.ok(e.retry_after_s <= 120, `retry_after_s is implausibly large: ${JSON.stringify(e)}`);
  assert.equal(typeof e.message, 'string');
  assert.ok(e.message.length > 0, 'empty error message');
}

test('health://check reports ok for every component', { timeout: TEST_TIMEOUT_MS }, async () => {
  await withClient(AUX_TOKEN, async (client) => {
    const { resources } = await client.listResources();
    const listed = resources.find((r) => r.uri === 'health://check');
    assert.ok(listed, `health://check missing from resources/list: ${JSON.stringify(resources)}`);
    assert.equal(listed.mimeType, 'application/json');

    const { contents } = await client.readResource({ uri: 'health://check' });
    assert.equal(contents.length, 1, JSON.stringify(contents));
    const [c] = contents;
    assert.equal(c.uri, 'health://check');
    assert.equal(c.mimeType, 'application/json');
    assert.equal(typeof c.text, 'string', `health://check is not text: ${JSON.stringify(c)}`);
    const h = JSON.parse(c.text);
    assert.equal(h.status, 'ok', c.text);
    assert.equal(h.components.audit_log, 'ok');
    assert.equal(h.components.state_store, 'ok');
    for (const [name, state] of Object.entries(h.components)) {
      assert.equal(state, 'ok', `component ${name}`);
    }
    assert.equal(typeof h.version, 'string', c.text);
    assert.ok(Number.isInteger(h.uptime_s) && h.uptime_s >= 0, c.text);
  });
});

test('an unknown tool is a JSON-RPC error and the client keeps working', { timeout: TEST_TIMEOUT_MS }, async () => {
  await withClient(AUX_TOKEN, async (client) => {
    await assert.rejects(client.callTool({ name: 'no_such_tool', arguments: {} }), (err) => {
      assert.ok(err instanceof McpError, `want McpError, got ${err?.constructor?.name}: ${err?.message}`);
      assert.equal(err.code, ErrorCode.InvalidParams, `want -32602, got ${err.code}: ${err.message}`);
      assert.match(err.message, /no_such_tool/);
      return true;
    });
    const u = await callOk(client, 'get_usage');
    assert.equal(u.principal, 'ts-pro-aux');
    assert.equal(u.tier, 'pro');
    const { tools } = await client.listTools();
    assert.ok(tools.some((t) => t.name === 'get_usage'));
  });
});

test('a 5 s run_code sends progress notifications; execute_code streams output as log messages', { timeout: 60_000 }, async () => {
  await withClient(STREAM_TOKEN, async (client) => {
    const progress = [];
    const started = Date.now();
    const res = await client.callTool(
      { name: 'run_code', arguments: { language: 'python', code: 'import time\nfor i in range(5):\n    time.sleep(1)\nprint("slept")' } },
      undefined,
      { onprogress: (p) => progress.push({ ...p, at: Date.now() - started }), timeout: 50_000 },
    );
    const out = structured(res);
    assert.equal(out.stdout, 'slept\n', JSON.stringify(out));
    assert.ok(progress.length >= 3, `want several progress notifications during the run, got ${JSON.stringify(progress)}`);
    for (let i = 1; i < progress.length; i++) {
      assert.ok(progress[i].progress > progress[i - 1].progress, `progress must increase: ${JSON.stringify(progress)}`);
    }
    assert.ok(progress[0].at < 4000, `first progress came only after ${progress[0].at} ms`);

    const lines = [];
    client.setNotificationHandler(LoggingMessageNotificationSchema, (n) => lines.push(n.params));
    await client.setLoggingLevel('info');
    const exec = structured(await client.callTool(
      { name: 'execute_code', arguments: { session_id: out.session_id, command: 'for i in 1 2 3; do echo "tick $i"; sleep 0.3; done' } },
      undefined,
      { onprogress: () => {}, timeout: 50_000 },
    ));
    assert.equal(exec.status, 'completed', JSON.stringify(exec));
    const streamed = lines.filter((l) => l.logger === 'sandbox.stdout').map((l) => l.data).join('');
    assert.equal(streamed, 'tick 1\ntick 2\ntick 3\n', JSON.stringify(lines));
  });
});

test('a chart from run_code comes back as a resource_link that resources/read returns, to its owner only', { timeout: 60_000 }, async () => {
  let uri;
  await withClient(FILES_TOKEN, async (client) => {
    const { resourceTemplates } = await client.listResourceTemplates();
    assert.ok(resourceTemplates.some((t) => t.uriTemplate === 'sandbox://{session_id}/{+path}'),
      `no sandbox:// template: ${JSON.stringify(resourceTemplates)}`);

    const code = 'import matplotlib\nmatplotlib.use("Agg")\nimport matplotlib.pyplot as plt\n'
      + 'plt.plot([1, 3, 2]); plt.savefig("chart.png"); plt.close()\nprint("saved")';
    const res = await client.callTool({ name: 'run_code', arguments: { language: 'python', code } }, undefined, { timeout: 50_000 });
    const out = structured(res);
    assert.equal(out.success, true, JSON.stringify(out));
    const image = res.content.find((c) => c.type === 'image' && c.mimeType === 'image/png');
    assert.ok(image, `no inline image: ${JSON.stringify(res.content.map((c) => c.type))}`);
    const link = res.content.find((c) => c.type === 'resource_link' && c.uri.startsWith('sandbox://'));
    assert.ok(link, `no sandbox:// resource_link: ${JSON.stringify(res.content)}`);
    uri = link.uri;
    assert.equal(uri, `sandbox://${out.session_id}/chart.png`);
    assert.equal(link.mimeType, 'image/png');
    const file = out.files.find((f) => f.name === 'chart.png');
    assert.equal(file?.uri, uri, JSON.stringify(out.files));
    // Over HTTP the broker knows its address, so the signed link is there too.
    assert.match(file.url, /^http:\/\/127\.0\.0\.1:\d+\/files\//, JSON.stringify(file));
    assert.ok(res.content.some((c) => c.type === 'resource_link' && c.uri === file.url), 'no resource_link for the signed URL');

    const { contents } = await client.readResource({ uri });
    assert.equal(contents.length, 1, JSON.stringify(contents));
    assert.equal(contents[0].uri, uri);
    assert.equal(contents[0].mimeType, 'image/png');
    assert.equal(typeof contents[0].blob, 'string', 'a PNG must come back as a blob');
    assert.ok(Buffer.from(contents[0].blob, 'base64').equals(Buffer.from(image.data, 'base64')),
      'resources/read and the inline image differ');
    const dl = await fetch(file.url, { signal: AbortSignal.timeout(10_000) });
    assert.equal(dl.status, 200);
    assert.ok(Buffer.from(await dl.arrayBuffer()).equals(Buffer.from(contents[0].blob, 'base64')),
      'the signed download and resources/read differ');
  });

  await withClient(FILES_OTHER_TOKEN, async (client) => {
    await assert.rejects(client.readResource({ uri }), (err) => {
      assert.ok(err instanceof McpError, `want McpError, got ${err?.constructor?.name}: ${err?.message}`);
      assert.match(err.message, /SANDBOX_NOT_FOUND/);
      assert.doesNotMatch(err.message, /ts-files/);
      return true;
    });
  });
});

test('a project build slower than the wait sends progress, then goes on as an execution the client polls', { timeout: 120_000 }, async () => {
  await withClient(BUILD_TOKEN, async (client) => {
    // The build lasts at least 4 waits: it cannot end inside the first call.
    const pkg = { name: 'slow', scripts: { build: `echo build started && sleep ${4 * BUILD_WAIT_S} && echo build finished`, start: 'node server.js' } };
    const created = await callOk(client, 'create_sandbox_for_project',
      { project_name: 'ts-slow-build', template: 'node', initial_files: { 'package.json': JSON.stringify(pkg) } });
    const progress = [];
    const first = structured(await client.callTool(
      { name: 'get_sandbox_output', arguments: { sandbox_id: created.sandbox_id, output_type: 'build_output' } },
      undefined,
      { onprogress: (p) => progress.push(p), timeout: 50_000 },
    ));
    assert.equal(first.status, 'running', JSON.stringify(first));
    assert.match(first.execution_id, /^exec_[0-9a-f]{32}$/);
    assert.match(first.hint, /get_execution_output/);
    assert.ok(progress.length >= 1, `want progress notifications during the build, got ${JSON.stringify(progress)}`);
    for (let i = 1; i < progress.length; i++) {
      assert.ok(progress[i].progress > progress[i - 1].progress, `progress must increase: ${JSON.stringify(progress)}`);
    }
    assert.match(progress[0].message, /build/, JSON.stringify(progress));

    // Polled by cursor to its end (the rate limit leaves 3 calls).
    let since = first.next_since;
    let page = { status: 'running', output: [] };
    let text = first.output;
    for (let i = 0; i < 3 && page.status === 'running'; i++) {
      page = structured(await client.callTool(
        { name: 'get_execution_output', arguments: { execution_id: first.execution_id, since, wait: true, max_wait_s: 50 } },
        undefined,
        { timeout: 55_000 },
      ));
      for (const ev of page.output) {
        if (ev.type === 'stdout') text += ev.data;
      }
      since = page.next_since;
    }
    assert.equal(page.status, 'completed', JSON.stringify(page));
    assert.match(text, /build started[\s\S]*build finished/, text);
  });
});
