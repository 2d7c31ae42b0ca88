// The official TypeScript SDK client's own OAuth flow against the broker's
// embedded authorization server: bare URL → 401 → protected-resource and
// authorization-server discovery → dynamic registration → PKCE → consent
// (the form the page shows, submitted with a bearer token) → token →
// run_code → refresh.
//
// Run by tests/oauth_test.go (go test -run TestTypeScriptOAuth ./tests/),
// which starts a broker with OAUTH_MODE=embedded and passes:
//
//   BROKER_URL             http://127.0.0.1:PORT (= PUBLIC_BASE_URL)
//   BROKER_OPERATOR_TOKEN  a static bearer token of principal "operator"
//
// Not named *.test.mjs, so the token-only suite (broker.test.mjs) does not
// pick it up.

import { test } from 'node:test';
import assert from 'node:assert/strict';

import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js';
import { UnauthorizedError } from '@modelcontextprotocol/sdk/client/auth.js';

function requireEnv(name) {
  const v = process.env[name];
  if (!v) {
    throw new Error(`${name} is not set; run this through "go test -run TestTypeScriptOAuth ./tests/"`);
  }
  return v;
}

const BASE_URL = requireEnv('BROKER_URL').replace(/\/+$/, '');
const MCP_URL = new URL(`${BASE_URL}/mcp`);
const OPERATOR_TOKEN = requireEnv('BROKER_OPERATOR_TOKEN');
// Never contacted: the test reads the code from the redirect, as a
// connector's callback would.
const REDIRECT_URI = 'http://127.0.0.1:1/callback';
const CLIENT_NAME = 'sandbox-broker TS SDK OAuth test';

// An in-memory OAuthClientProvider, as the SDK's docs describe one.
class MemoryProvider {
  constructor() {
    this.info = undefined;
    this.stored = undefined;
    this.verifier = undefined;
    this.authorizationUrl = undefined;
  }
  get redirectUrl() {
    return REDIRECT_URI;
  }
  get clientMetadata() {
    return {
      client_name: CLIENT_NAME,
      redirect_uris: [REDIRECT_URI],
      grant_types: ['authorization_code', 'refresh_token'],
      response_types: ['code'],
      token_endpoint_auth_method: 'none',
    };
  }
  clientInformation() {
    return this.info;
  }
  saveClientInformation(info) {
    this.info = info;
  }
  tokens() {
    return this.stored;
  }
  saveTokens(tokens) {
    this.stored = tokens;
  }
  redirectToAuthorization(url) {
    this.authorizationUrl = url;
  }
  saveCodeVerifier(v) {
    this.verifier = v;
  }
  codeVerifier() {
    return this.verifier;
  }
}

// approve plays the operator's browser: open the authorization URL, follow
// it to the consent page, submit the form it shows with a bearer token, and
// return the code from the redirect back to the client.
async function approve(authorizationUrl) {
  let res = await fetch(authorizationUrl, { redirect: 'manual' });
  assert.equal(res.status, 302, `authorize: ${res.status} ${await res.text()}`);
  const pageUrl = new URL(res.headers.get('location'), BASE_URL);
  res = await fetch(pageUrl, { redirect: 'manual' });
  assert.equal(res.status, 200);
  assert.match(res.headers.get('content-security-policy'), /frame-ancestors 'none'/);
  const html = await res.text();
  assert.ok(html.includes(CLIENT_NAME), 'the consent page names the client');
  assert.ok(html.includes('127.0.0.1:1'), 'the consent page names the redirect host');
  const cookie = res.headers.get('set-cookie').split(';')[0];
  const action = new URL(html.match(/<form method="post" action="([^"]+)"/)[1], pageUrl);
  const form = new URLSearchParams();
  for (const m of html.matchAll(/<input type="hidden" name="([^"]+)" value="([^"]*)">/g)) {
    form.set(m[1], m[2]);
  }
  form.set('token', OPERATOR_TOKEN);
  form.set('action', 'approve');
  res = await fetch(action, {
    method: 'POST',
    body: form,
    headers: { cookie, 'content-type': 'application/x-www-form-urlencoded' },
    redirect: 'manual',
  });
  assert.equal(res.status, 303, `consent: ${res.status} ${await res.text()}`);
  const back = new URL(res.headers.get('location'));
  assert.equal(back.origin + back.pathname, REDIRECT_URI);
  assert.equal(back.searchParams.get('iss'), BASE_URL, 'RFC 9207 iss');
  assert.ok(back.searchParams.get('code'));
  return back.searchParams.get('code');
}

function text(res) {
  assert.ok(!res.isError, `tool error: ${JSON.stringify(res.content)}`);
  return JSON.parse(res.content[0].text);
}

test('the SDK goes from a bare URL to run_code through OAuth, then refreshes', { timeout: 120_000 }, async () => {
  const provider = new MemoryProvider();
  let transport = new StreamableHTTPClientTransport(MCP_URL, { authProvider: provider });
  let client = new Client({ name: 'oauth-flow-test', version: '1.0.0' });
  await assert.rejects(client.connect(transport), UnauthorizedError);

  // The SDK discovered, registered and built a PKCE authorization URL.
  assert.ok(provider.info?.client_id, 'dynamic registration');
  const authUrl = provider.authorizationUrl;
  assert.ok(authUrl, 'redirectToAuthorization was called');
  assert.equal(`${authUrl.origin}${authUrl.pathname}`, `${BASE_URL}/oauth/authorize`);
  assert.equal(authUrl.searchParams.get('code_challenge_method'), 'S256');
  assert.equal(authUrl.searchParams.get('resource'), MCP_URL.href);
  assert.equal(authUrl.searchParams.get('scope'), 'sandbox');

  await transport.finishAuth(await approve(authUrl));
  assert.ok(provider.stored?.access_token && provider.stored?.refresh_token, 'tokens saved');

  transport = new StreamableHTTPClientTransport(MCP_URL, { authProvider: provider });
  client = new Client({ name: 'oauth-flow-test', version: '1.0.0' });
  await client.connect(transport);
  try {
    const run = text(await client.callTool({ name: 'run_code', arguments: { language: 'python', code: 'print(6 * 7)' } }));
    assert.equal(run.stdout, '42\n', JSON.stringify(run));

    // Spoil the access token: the broker answers 401 invalid_token and the
    // SDK refreshes (rotating the refresh token) and retries.
    const firstRefresh = provider.stored.refresh_token;
    provider.stored = { ...provider.stored, access_token: 'spoiled' };
    const usage = text(await client.callTool({ name: 'get_usage', arguments: {} }));
    assert.equal(usage.principal, 'operator');
    assert.ok(provider.stored.access_token !== 'spoiled', 'a new access token');
    assert.notEqual(provider.stored.refresh_token, firstRefresh, 'the refresh token rotated');
  } finally {
    await client.close();
  }
});
