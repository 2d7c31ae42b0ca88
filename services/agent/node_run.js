// sandbox-broker agent: the Node runner.
//
// `node --enable-source-maps -e <this file> <toolchain> <path>` runs the
// JavaScript file at path as `node path` would (a direct start, in a
// session the agent made). Without a path it is a spare: started by the
// agent in the agent's own session (see infra.go) with a stream socket on
// fd 3 and the run's stdout and stderr already in place, it gets Node's
// start-up over with, then waits for one run:
//
//   spare -> agent  "sealed"  (it is non-dumpable now)
//   spare -> agent  "ready"
//   agent -> spare  {"path": "/tmp/run-1/main.js", "cwd": "/mnt/data"}
//   spare -> agent  "ok"      (after setsid: it is no longer in the
//                              agent's session)
//   agent -> spare  "go"      (the agent knows it runs the code: nothing
//                              runs before, so a fallback never runs it twice)
//
// A spare that was tampered with while idle (pending signals, changed
// limits, nice or affinity) exits without acknowledging the run. Files it
// requires that end in .ts are compiled on load, as tsx did.
'use strict';
// No inspector: SIGUSR1 would start Node's, listening on loopback for any
// process of the sandbox to run code in this one (and through a resident
// or an idle spare outlive a run). A listener of our own replaces Node's
// handler of the signal (Node 18 has no --disable-sigusr1), so the signal
// does nothing. First thing, before the agent lets any run start. A run
// keeps it (without a listener the signal would end the run instead).
process.on('SIGUSR1', () => {});
const fs = require('fs');
const path = require('path');
const Module = require('module');

const toolchain = process.argv[1];
const CTRL_FD = 3;

function registerTypeScript() {
  let ts = null;
  Module._extensions['.ts'] = function (module, filename) {
    ts = ts || require(path.join(toolchain, 'node_modules', 'typescript'));
    const out = ts.transpileModule(fs.readFileSync(filename, 'utf8'), {
      fileName: filename,
      compilerOptions: {
        target: ts.ScriptTarget.ES2022,
        module: ts.ModuleKind.CommonJS,
        esModuleInterop: true,
        inlineSourceMap: true,
        inlineSources: true,
      },
    });
    module._compile(out.outputText, filename);
  };
}

function runMain(main) {
  registerTypeScript();
  process.argv = [process.execPath, main];
  // A child_process.fork() of the run must start Node, not this script.
  process.execArgv = process.execArgv.filter((a) => a === '--enable-source-maps');
  Module.runMain(main);
}

if (process.argv.length > 2) {
  runMain(process.argv[2]);
} else {
  spare();
}

// spare waits for its run and becomes it.
function spare() {
const nativePath = path.join(toolchain, 'sandbox_proc.node');
const native = require(nativePath);
native.setDumpable(false);
delete require.cache[nativePath];
send('sealed');

// What another process of the same uid could change in an idle spare.
function tamperable() {
  const status = fs.readFileSync('/proc/self/status', 'utf8');
  const stat = fs.readFileSync('/proc/self/stat', 'utf8');
  const fields = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
  return [
    fs.readFileSync('/proc/self/limits', 'utf8'),
    fields[16], // nice
    (status.match(/^Cpus_allowed_list:.*$/m) || [''])[0],
  ].join('\n');
}

function pendingSignals() {
  const status = fs.readFileSync('/proc/self/status', 'utf8');
  // The agent's SIGCONT (bit 18) wakes a stopped spare; anything else is
  // someone else's.
  const cont = 1n << 17n;
  let pending = 0n;
  for (const m of status.matchAll(/^(?:SigPnd|ShdPnd):\s*([0-9a-f]+)$/gm)) {
    pending |= BigInt('0x' + m[1]);
  }
  return (pending & ~cont) !== 0n;
}

function send(s) {
  fs.writeSync(CTRL_FD, s + '\n');
}

let pending = '';
function readLine() {
  const buf = Buffer.alloc(4096);
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
    if (n === 0 || pending.length > 65536) {
      return null;
    }
    pending += buf.toString('utf8', 0, n);
  }
}

const before = tamperable();
send('ready');
let job;
try {
  job = JSON.parse(readLine());
  if (typeof job.path !== 'string' || typeof job.cwd !== 'string') {
    throw new Error('bad job');
  }
} catch {
  process.exit(0);
}
if (pendingSignals() || tamperable() !== before) {
  process.exit(0); // no ack: the agent starts the run another way
}
try {
  native.setsid();
  send('ok');
  if (readLine() !== 'go') {
    process.exit(0);
  }
  fs.closeSync(CTRL_FD);
} catch {
  process.exit(0);
}
native.setDumpable(true);
try {
  process.chdir(job.cwd);
} catch (e) {
  process.stderr.write('sandbox agent: chdir ' + job.cwd + ': ' + e.message + '\n');
  process.exit(1);
}
runMain(job.path);
}
