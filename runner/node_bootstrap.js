// Runs in the child Node.js of a JavaScript code work item: load the code, call `main(args)`,
// save the result. The counterpart of python_bootstrap.py (same files, same payloads).
//
// Not loaded as a module of the runner: its source is passed with `node -e`, so that the
// work's `require()` resolves from the work directory, as for any script run there. Usage:
//
//     node -e <this source> CODE_PATH ARGUMENTS_PATH RESULT_PATH
//
// The code is CommonJS: it defines `main` (a function or an async function) at its top level
// or exports it (`module.exports.main`); `main` is called with the arguments object and what
// it returns (or resolves to) is the result. The result must be JSON as it is: null,
// booleans, finite numbers, strings, arrays and plain objects; anything else (undefined
// inside it, NaN, a function, a BigInt, a Date, a cycle) is refused, not converted. A `main`
// that returns nothing gives null, as a Python `main` that returns None does.
"use strict";

const fs = require("fs");
const path = require("path");
const vm = require("vm");
const { createRequire } = require("module");

const TRACEBACK_LINES = 30;
const [codePath, argumentsPath, resultPath] = process.argv.slice(-3);

function describe(error) {
  if (error instanceof Error) {
    return error.message ? `${error.name}: ${error.message}` : error.name;
  }
  return `a non-Error value: ${String(error)}`;
}

function failure(message, error) {
  if (error instanceof Error && error.stack) {
    const lines = error.stack.split("\n");
    process.stderr.write(lines.slice(-TRACEBACK_LINES).join("\n") + "\n");
  }
  return { ok: false, error: message };
}

// Why `value` is not JSON as it is, or null when it is.
function notJson(value, where, seen) {
  if (value === null || typeof value === "string" || typeof value === "boolean") {
    return null;
  }
  if (typeof value === "number") {
    return Number.isFinite(value) ? null : `${where} is ${value}, which JSON has no value for`;
  }
  if (typeof value !== "object") {
    return `${where} is ${typeof value === "undefined" ? "undefined" : `a ${typeof value}`}`;
  }
  if (seen.has(value)) {
    return `${where} refers back to itself (a cycle)`;
  }
  const prototype = Object.getPrototypeOf(value);
  if (!Array.isArray(value) && prototype !== Object.prototype && prototype !== null) {
    const name = (prototype && prototype.constructor && prototype.constructor.name) || "object";
    return `${where} is a ${name}, not a plain object`;
  }
  seen.add(value);
  const entries = Array.isArray(value)
    ? value.map((item, index) => [`${where}[${index}]`, item])
    : Object.keys(value).map((key) => [`${where}.${key}`, value[key]]);
  for (const [inner, item] of entries) {
    const problem = notJson(item, inner, seen);
    if (problem !== null) {
      return problem;
    }
  }
  seen.delete(value);
  return null;
}

function load() {
  const source = fs.readFileSync(codePath, "utf8");
  // Named as a file of the work directory, so that require() resolves from there.
  const filename = path.join(process.cwd(), "work_item.js");
  const module = { exports: {} };
  const wrapped = vm.compileFunction(
    source + "\n;return typeof main === 'function' ? main : undefined;",
    ["exports", "require", "module", "__filename", "__dirname"],
    { filename },
  );
  const declared = wrapped(module.exports, createRequire(filename), module, filename, process.cwd());
  const exported = module.exports && module.exports.main;
  return declared || (typeof exported === "function" ? exported : undefined);
}

async function call(args) {
  let entry;
  try {
    entry = load();
  } catch (error) {
    return failure(`loading the code raised ${describe(error)}`, error);
  }
  if (typeof entry !== "function") {
    return failure("the code defines no main() function");
  }
  let value;
  try {
    value = await entry(args);
  } catch (error) {
    return failure(`main() raised ${describe(error)}`, error);
  }
  if (value === undefined) {
    value = null;
  }
  const problem = notJson(value, "the result", new Set());
  if (problem !== null) {
    return failure(`main() returned a value that is not JSON: ${problem}`);
  }
  return { ok: true, result: value };
}

async function run() {
  const args = JSON.parse(fs.readFileSync(argumentsPath, "utf8"));
  const payload = await call(args);
  fs.writeFileSync(resultPath, JSON.stringify(payload), "utf8");
  // Timers or sockets the code left open must not keep the work running past its result.
  process.exit(payload.ok ? 0 : 1);
}

run();
