// sandbox-broker agent: the TypeScript resident.
//
// Started by the agent as `node -e <this file> <toolchain>` with a stream
// socket on fd 3, in the agent's session (see infra.go). It loads the
// TypeScript compiler and the node and ES2022 library types once, then
// type-checks each run's main.ts and writes main.js beside it. It never
// runs code of a run. Messages are JSON lines:
//
//   resident -> agent  {"sealed": true}       (it is non-dumpable now)
//   resident -> agent  {"ready": true, "pid": N, "typescript": "5.9.3"}
//   agent -> resident  {"file": "/tmp/run-1/main.ts", "out": "/tmp/run-1/main.js"}
//   resident -> agent  {"errors": N, "diagnostics": "main.ts(1,7): error TS2322: ..."}
//
// With errors the output is not written. The resident exits when fd 3
// reaches EOF.
'use strict';
// No inspector: SIGUSR1 would start Node's, listening on loopback for any
// process of the sandbox to run code in this one (and through a resident
// or an idle spare outlive a run). A listener of our own replaces Node's
// handler of the signal (Node 18 has no --disable-sigusr1), so the signal
// does nothing. First thing, before the agent lets any run start.
process.on('SIGUSR1', () => {});
const fs = require('fs');
const path = require('path');

const toolchain = process.argv[1];
const CTRL_FD = 3;
// Non-dumpable first: code of the same uid cannot then trace this process
// or write its memory through /proc and so outlive a run in it.
require(path.join(toolchain, 'sandbox_proc.node')).setDumpable(false);
fs.writeSync(CTRL_FD, 'sealed\n');
const ts = require(path.join(toolchain, 'node_modules', 'typescript'));

const MAX_DIAGNOSTICS = 64 << 10;

// Compiler options: node's CommonJS, as `tsx main.ts` ran it, and tsc's
// defaults otherwise (not strict). Every file is a module, so a run's
// top-level names never clash with the global ones.
const options = {
  target: ts.ScriptTarget.ES2022,
  module: ts.ModuleKind.CommonJS,
  moduleResolution: ts.ModuleResolutionKind.Node10,
  moduleDetection: ts.ModuleDetectionKind.Force,
  lib: ['lib.es2022.d.ts'],
  types: ['node'],
  typeRoots: [path.join(toolchain, 'node_modules', '@types')],
  esModuleInterop: true,
  resolveJsonModule: true,
  skipLibCheck: true,
  inlineSourceMap: true,
  inlineSources: true,
  newLine: ts.NewLineKind.LineFeed,
};

// Every run's main.ts is checked under one name, so that each program
// reuses the last one's structure (a new root file costs a new program:
// a hundred milliseconds and more). Nothing exists beside it: relative
// imports resolve nowhere, as beside the run's own main.ts.
const MAIN = '/__sandbox__/main.ts';
let mainText = '';
let mainVersion = 0;

const versions = new Map(); // file -> version, for files read from disk
const host = {
  getScriptFileNames: () => [MAIN],
  getScriptVersion: (f) => {
    if (f === MAIN) {
      return String(mainVersion);
    }
    let v = versions.get(f);
    if (v === undefined) {
      try {
        const st = fs.statSync(f);
        v = st.mtimeMs + ':' + st.size;
      } catch {
        v = 'missing';
      }
      versions.set(f, v);
    }
    return v;
  },
  getScriptSnapshot: (f) => {
    const text = f === MAIN ? mainText : ts.sys.readFile(f);
    return text === undefined ? undefined : ts.ScriptSnapshot.fromString(text);
  },
  getCurrentDirectory: () => path.dirname(MAIN),
  getCompilationSettings: () => options,
  getDefaultLibFileName: (o) => ts.getDefaultLibFilePath(o),
  fileExists: (f) => f === MAIN || ts.sys.fileExists(f),
  readFile: (f) => (f === MAIN ? mainText : ts.sys.readFile(f)),
  readDirectory: ts.sys.readDirectory,
  directoryExists: ts.sys.directoryExists,
  getDirectories: ts.sys.getDirectories,
};
const service = ts.createLanguageService(host, ts.createDocumentRegistry());
const libDir = path.dirname(ts.getDefaultLibFilePath(options));
const typesDir = options.typeRoots[0];

// format writes diagnostics as tsc does (pretty off), naming the run's
// file main.ts.
function format(diags) {
  return diags
    .map((d) => {
      let where = '';
      if (d.file) {
        const { line, character } = d.file.getLineAndCharacterOfPosition(d.start);
        where = (d.file.fileName === MAIN ? 'main.ts' : d.file.fileName) + '(' + (line + 1) + ',' + (character + 1) + '): ';
      }
      return where + 'error TS' + d.code + ': ' + ts.flattenDiagnosticMessageText(d.messageText, '\n') + '\n';
    })
    .join('');
}

// check type-checks the code of file and, without errors, writes its
// JavaScript to out.
function check(file, out) {
  // Files other than the libraries may have changed since the last run.
  for (const f of versions.keys()) {
    if (!f.startsWith(libDir) && !f.startsWith(typesDir)) {
      versions.delete(f);
    }
  }
  mainText = fs.readFileSync(file, 'utf8');
  mainVersion++;
  const program = service.getProgram();
  const diags = [];
  for (const sf of program.getSourceFiles()) {
    if (sf.isDeclarationFile && (sf.fileName.startsWith(libDir) || sf.fileName.startsWith(typesDir))) {
      continue;
    }
    diags.push(...program.getSyntacticDiagnostics(sf), ...program.getSemanticDiagnostics(sf));
  }
  const errors = diags.filter((d) => d.category === ts.DiagnosticCategory.Error);
  if (errors.length === 0) {
    const emitted = service.getEmitOutput(MAIN).outputFiles.find((o) => o.name.endsWith('.js'));
    if (!emitted) {
      throw new Error('no output');
    }
    fs.writeFileSync(out, emitted.text, { mode: 0o600 });
  }
  let text = format(errors);
  if (text.length > MAX_DIAGNOSTICS) {
    text = text.slice(0, MAX_DIAGNOSTICS) + '\n…\n';
  }
  return { errors: errors.length, diagnostics: text };
}

function send(msg) {
  const b = Buffer.from(JSON.stringify(msg) + '\n');
  for (let off = 0; off < b.length; ) {
    off += fs.writeSync(CTRL_FD, b, off);
  }
}

// Lines from fd 3, read with blocking reads: the resident has nothing else
// to do in between.
let pending = '';
function readLine() {
  const buf = Buffer.alloc(64 << 10);
  for (;;) {
    const i = pending.indexOf('\n');
    if (i >= 0) {
      const line = pending.slice(0, i);
      pending = pending.slice(i + 1);
      return line;
    }
    let n;
    try {
      n = fs.readSync(CTRL_FD, buf, 0, buf.length, null);
    } catch (e) {
      if (e.code === 'EAGAIN' || e.code === 'EINTR') {
        continue;
      }
      return null;
    }
    if (n === 0) {
      return null;
    }
    pending += buf.toString('utf8', 0, n);
    if (pending.length > 1 << 20) {
      return null;
    }
  }
}

// Warm up: bind the library and node types once, off every run's path.
mainText =
  'import * as fs from "fs";\nconst n: number = fs.readdirSync("/").length;\n' +
  'console.log(n, [1].map(String), new Map<string, number>(), process.argv, Promise.resolve(1));\n';
mainVersion++;
service.getProgram().getSemanticDiagnostics(service.getProgram().getSourceFile(MAIN));
service.getEmitOutput(MAIN);

send({ ready: true, pid: process.pid, typescript: ts.version });
for (;;) {
  const line = readLine();
  if (line === null) {
    process.exit(0);
  }
  let reply;
  try {
    const req = JSON.parse(line);
    if (typeof req.file !== 'string' || typeof req.out !== 'string') {
      throw new Error('bad request');
    }
    reply = check(req.file, req.out);
  } catch (e) {
    reply = { error: String((e && e.message) || e).slice(0, 300) };
  }
  send(reply);
}
