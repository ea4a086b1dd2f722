// Validates custom resources (cert-manager's and the Prometheus Operator's) against the schemas of
// the Go API types their CRDs are generated from, as the npm packages @kubernetes-models/cert-manager
// and @kubernetes-models/prometheus-operator ship them (ajv validators generated from
// github.com/cert-manager/cert-manager/pkg/apis/certmanager/v1 and
// github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1; package.json's
// "go-generate" inputs, https://github.com/tommy351/kubernetes-models-ts third-party/).
//
//     node crd_validate.mjs INSTALL_DIR < docs.json     # a JSON list of objects
//
// INSTALL_DIR is where `npm install` put those packages (it holds node_modules). Prints one line per
// problem, "Kind/name: /json/pointer: what", and exits 1 when there is any, 0 when there is none,
// 2 when the input or INSTALL_DIR is unusable.
//
// The generated schemas allow properties they do not name (the validators never look at them), so a
// misspelt field would pass. Each object is therefore handed to its validator through a Proxy that
// records every property the validator reads: a property of the object that no validator read is one
// the Go type does not have, and is reported as unknown. A map (labels, matchLabels) is read key by
// key by its validator, so its keys count as read.

import { readFileSync, existsSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

// API group -> the npm package holding its models (each at GROUP/VERSION/KIND.js, class KIND).
const PACKAGES = {
  "cert-manager.io": "@kubernetes-models/cert-manager",
  "monitoring.coreos.com": "@kubernetes-models/prometheus-operator",
};

function usage(message) {
  process.stderr.write(`crd_validate: ${message}\n`);
  process.exit(2);
}

const installDir = process.argv[2];
if (!installDir || !existsSync(join(installDir, "node_modules"))) {
  usage(`no node_modules under ${installDir ?? "(no INSTALL_DIR given)"}: npm install the packages there first`);
}
let docs;
try {
  docs = JSON.parse(readFileSync(0, "utf8"));
} catch (e) {
  usage(`stdin is not JSON: ${e.message}`);
}
if (!Array.isArray(docs)) usage("stdin must be a JSON list of objects");

async function modelFor(apiVersion, kind) {
  const [group, version] = String(apiVersion).split("/");
  const pkg = PACKAGES[group];
  if (!pkg || !version) return null;
  const file = join(installDir, "node_modules", pkg, group, version, `${kind}.js`);
  if (!existsSync(file)) return null;
  // Imported by path: the packages' "exports" map names every kind, but a bare specifier would
  // resolve from this file's folder, which has no node_modules.
  return (await import(pathToFileURL(file).href))[kind] ?? null;
}

// The object as the validator sees it, recording in `read` (JSON pointer -> names) what it reads.
function tracked(value, pointer, read) {
  if (value === null || typeof value !== "object") return value;
  const names = read.get(pointer) ?? new Set();
  read.set(pointer, names);
  return new Proxy(value, {
    get(target, name, receiver) {
      const got = Reflect.get(target, name, receiver);
      if (typeof name !== "string" || !Object.hasOwn(target, name)) return got;
      names.add(name);
      return tracked(got, `${pointer}/${name}`, read);
    },
  });
}

function unread(value, pointer, read, out) {
  if (value === null || typeof value !== "object") return;
  for (const name of Object.keys(value)) {
    const child = `${pointer}/${name}`;
    if (!Array.isArray(value) && !read.get(pointer)?.has(name)) out.push(child);
    else unread(value[name], child, read, out);
  }
}

function describe(error) {
  const allowed = error.params?.allowedValues;
  const detail = allowed ? ` (${allowed.map((v) => JSON.stringify(v)).join(", ")})` : "";
  return `${error.instancePath || "/"}: ${error.message ?? error.keyword}${detail}`;
}

let problems = 0;
function report(doc, line) {
  problems += 1;
  process.stdout.write(`${doc?.kind ?? "?"}/${doc?.metadata?.name ?? "?"}: ${line}\n`);
}

for (const doc of docs) {
  const Model = await modelFor(doc?.apiVersion, doc?.kind);
  if (!Model) {
    report(doc, `no schema for ${doc?.apiVersion} ${doc?.kind} in ${Object.values(PACKAGES).join(", ")}`);
    continue;
  }
  const model = new Model(doc);
  const read = new Map();
  try {
    Model.prototype.validate.call(tracked(model, "", read));
  } catch (e) {
    const errors = Array.isArray(e.errors) && e.errors.length ? e.errors : [{ message: e.message }];
    // ajv reports an error once per schema branch that reached it: print each line once.
    for (const line of new Set(errors.map(describe))) report(doc, line);
  }
  const unknown = [];
  unread(model.toJSON(), "", read, unknown);
  for (const pointer of unknown) report(doc, `${pointer}: unknown field (${doc.apiVersion} ${doc.kind} has no such field)`);
}
process.exit(problems ? 1 : 0);
