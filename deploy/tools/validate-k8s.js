#!/usr/bin/env node
// Offline schema validation of rendered Kubernetes manifests (kubectl kustomize output).
//   node validate-k8s.js <rendered.yaml>...
// Built-in kinds are validated against the Kubernetes OpenAPI schemas shipped in the npm package
// kubernetes-models; ServiceMonitor against @kubernetes-models/prometheus-operator. Those
// schemas allow unknown fields, so every object is also walked against the field names in the
// packages' type declarations (.d.ts) to catch misspelled or misplaced keys (as
// `kubectl apply --validate=strict` would on a live cluster).
'use strict';
const fs = require('fs');
const path = require('path');
const yaml = require('js-yaml');

// apiVersion/kind -> module path (package subpath) of the model class.
function modulePath(apiVersion, kind) {
  const [group, version] = apiVersion.includes('/') ? apiVersion.split('/') : ['', apiVersion];
  if (group === 'monitoring.coreos.com') {
    return `@kubernetes-models/prometheus-operator/${group}/${version}/${kind}`;
  }
  if (group === '') return `kubernetes-models/${version}/${kind}`;
  // kubernetes-models names core-ish groups by their short name (apps, batch, autoscaling, policy).
  const dir = group.endsWith('.k8s.io') && !fs.existsSync(pkgDir('kubernetes-models', group))
    ? group.replace(/\.k8s\.io$/, '') : group;
  return `kubernetes-models/${dir}/${version}/${kind}`;
}

function pkgDir(pkg, sub) {
  return path.join(path.dirname(require.resolve(`${pkg}/package.json`)), sub || '');
}

// ---- strict field check from the .d.ts declarations ----------------------------------------
const ifaceCache = new Map(); // dtsFile -> {props: {name: type}, imports: {Name: dtsFile}}

function parseDts(file) {
  if (ifaceCache.has(file)) return ifaceCache.get(file);
  const src = fs.readFileSync(file, 'utf8').replace(/\/\*[\s\S]*?\*\//g, '');
  const imports = {};
  for (const m of src.matchAll(/import\s*\{([^}]*)\}\s*from\s*"([^"]+)"/g)) {
    let target = m[2];
    target = target.startsWith('.') ? path.resolve(path.dirname(file), target)
      : require.resolve(target).replace(/\.js$/, '');
    for (const name of m[1].split(',').map((s) => s.trim()).filter(Boolean)) {
      imports[name] = target + '.d.ts';
    }
  }
  const im = src.match(/export interface (\w+)[^{]*\{([\s\S]*?)\n\}/);
  const props = im ? parseMembers(im[2]) : {};
  const r = { props, imports, inline: im ? null : src };
  ifaceCache.set(file, r);
  return r;
}

// Top-level members of an interface or object-literal type body: "name"?: type;
function parseMembers(body) {
  const props = {};
  let depth = 0; let line = '';
  for (const ch of body) {
    if (ch === '{' || ch === '<' || ch === '(') depth++;
    if (ch === '}' || ch === '>' || ch === ')') depth--;
    if (ch === ';' && depth === 0) {
      const mm = line.trim().match(/^"?([^"?:]+)"?\??:\s*([\s\S]*)$/);
      if (mm) props[mm[1]] = mm[2].trim();
      line = '';
    } else line += ch;
  }
  return props;
}

function checkType(value, type, file, where, errors) {
  if (value === null || value === undefined) return;
  type = type.trim();
  let m;
  if ((m = type.match(/^Array<([\s\S]*)>$/))) {
    if (Array.isArray(value)) value.forEach((v, i) => checkType(v, m[1], file, `${where}[${i}]`, errors));
    return;
  }
  if (/^\{\s*\[key: string\]/.test(type)) {
    // map: values keyed freely; check the value type.
    const vm = type.match(/\]:\s*([\s\S]*?);?\s*\}$/);
    if (vm && typeof value === 'object') {
      for (const [k, v] of Object.entries(value)) checkType(v, vm[1], file, `${where}.${k}`, errors);
    }
    return;
  }
  if (type.startsWith('{') && type.endsWith('}') && typeof value === 'object' && !Array.isArray(value)) {
    checkProps(value, parseMembers(type.slice(1, -1)), file, where, errors);
    return;
  }
  if ((m = type.match(/^(I\w+)$/)) && typeof value === 'object' && !Array.isArray(value)) {
    const info = parseDts(file);
    const target = info.imports[m[1]];
    if (target && fs.existsSync(target)) checkObject(value, target, where, errors);
  }
}

function checkObject(obj, file, where, errors) {
  checkProps(obj, parseDts(file).props, file, where, errors);
}

function checkProps(obj, props, file, where, errors) {
  if (!Object.keys(props).length) return; // free-form (e.g. RawExtension, Quantity)
  for (const [k, v] of Object.entries(obj)) {
    if (!(k in props)) {
      errors.push(`${where}: unknown field "${k}" (known: ${Object.keys(props).join(', ')})`);
      continue;
    }
    checkType(v, props[k], file, `${where}.${k}`, errors);
  }
}

// ---- main ----------------------------------------------------------------------------------
let failures = 0; let count = 0;
for (const file of process.argv.slice(2)) {
  const docs = yaml.loadAll(fs.readFileSync(file, 'utf8')).filter((d) => d);
  if (!docs.length) { console.error(`${file}: no objects`); failures++; }
  for (const doc of docs) {
    count++;
    const id = `${file}: ${doc.kind}/${doc.metadata && doc.metadata.name}`;
    if (!doc.apiVersion || !doc.kind) { console.error(`${id}: missing apiVersion/kind`); failures++; continue; }
    let Model; const mod = modulePath(doc.apiVersion, doc.kind);
    try {
      Model = require(mod)[doc.kind];
    } catch (e) {
      console.error(`${id}: no schema for ${doc.apiVersion} ${doc.kind} (${mod})`); failures++; continue;
    }
    const errors = [];
    try {
      new Model(doc).validate();
    } catch (e) {
      errors.push(e.message);
    }
    checkObject(doc, require.resolve(mod).replace(/\.js$/, '.d.ts'), doc.kind, errors);
    if (errors.length) {
      failures++;
      console.error(`${id}: INVALID\n  ${errors.join('\n  ')}`);
    } else {
      console.log(`${id}: ok (${doc.apiVersion})`);
    }
  }
}
console.log(`${count} objects, ${failures} invalid`);
process.exit(failures ? 1 : 0);
