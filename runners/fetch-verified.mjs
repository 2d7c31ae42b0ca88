// fetch-verified.mjs URL SRI OUTFILE
// Download URL with Node's built-in fetch and write it to OUTFILE only if its
// digest matches the Subresource-Integrity string SRI ("sha512-<base64>").
// Used in the discarded build stage of the typescript runner to bootstrap a
// pinned npm from the npm registry without installing Debian's npm (387 packages).
import { createHash } from "node:crypto";
import { writeFileSync } from "node:fs";

const [url, sri, out] = process.argv.slice(2);
if (!url || !sri || !out) {
  console.error("usage: node fetch-verified.mjs URL SRI OUTFILE");
  process.exit(2);
}
const [alg, want] = sri.split(/-(.*)/s);
let res;
try {
  res = await fetch(url);
} catch (e) {
  const c = e.cause ?? e;
  console.error(`GET ${url} failed: ${c.code ?? ""} ${c.message ?? c}`);
  if (/CERT|SELF_SIGNED|ISSUER/.test(String(c.code))) {
    console.error("TLS verification failed: put the host's CA bundle in the build context as host-ca.crt (runners/build.sh does this)");
  }
  process.exit(1);
}
if (!res.ok) {
  console.error(`GET ${url}: HTTP ${res.status}`);
  process.exit(1);
}
const body = Buffer.from(await res.arrayBuffer());
const got = createHash(alg).update(body).digest("base64");
if (got !== want) {
  console.error(`integrity mismatch for ${url}: want ${alg}-${want}, got ${alg}-${got}`);
  process.exit(1);
}
writeFileSync(out, body);
console.log(`fetched ${url} (${body.length} bytes, ${alg} ok)`);
