#!/bin/sh
# Type-checks every fixture in this directory against the published types of
# @codesandbox/sdk 2.4.2 (dist/esm/api-clients/client/types.gen.d.ts): each
# fixture becomes an object literal of the type its file name names, so an
# unknown key, a missing required key or a wrong JSON type fails tsc.
# Files in pitcher/ are named <namespace>.<type>[.<variant>].json after
# dist/esm/pitcher-protocol/messages/<namespace>.d.ts.
# Needs node and npm; run it after editing a fixture.
set -eu
dir=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
npm pack --silent @codesandbox/sdk@2.4.2 >/dev/null
tar xzf codesandbox-sdk-2.4.2.tgz
npm install --silent --no-audit --no-fund --no-save typescript@5.9.3 >/dev/null
node -e '
const fs = require("fs"), path = require("path");
const dir = process.argv[1];
const lit = (f) => fs.readFileSync(f, "utf8").trim();
let out = `import type * as T from "./package/dist/esm/api-clients/client/types.gen";
import type * as P from "./package/dist/esm/pitcher-protocol";
// A message type names its success result (or, for *.error.json, its error);
// a notification type names its params.
type Ok<M> = M extends { response: infer R } ? (Extract<R, { status: P.PitcherResponseStatus.RESOLVED }> extends { result: infer X } ? X : never) : M extends { method: string; params: infer Q } ? Q : M;
type Err<M> = M extends { response: infer R } ? (Extract<R, { status: P.PitcherResponseStatus.REJECTED }> extends { error: infer X } ? X : never) : never;
`;
const names = (d) => fs.readdirSync(d).filter((f) => f.endsWith(".json")).sort();
for (const f of names(dir)) {
  out += `export const ${f.slice(0, -5).replace(/\./g, "_")}: T.${f.split(".")[0]} = ${lit(path.join(dir, f))};\n`;
}
for (const f of names(path.join(dir, "pitcher"))) {
  const [ns, type, variant] = f.split(".");
  const wrap = variant === "error" ? "Err" : "Ok";
  out += `export const p_${f.slice(0, -5).replace(/\./g, "_")}: ${wrap}<P.${ns}.${type}> = ${lit(path.join(dir, "pitcher", f))};\n`;
}
fs.writeFileSync("check.ts", out);
' "$dir"
npx tsc --noEmit --strict --exactOptionalPropertyTypes check.ts
echo "fixtures match the types of @codesandbox/sdk 2.4.2"
