#!/usr/bin/env node
// Without kubectl: writes the Kubernetes objects of deploy/k8s as validate-k8s.js should see them,
// from the raw YAML files, so that the schema check still runs on a host without kubectl.
//   node raw-k8s.js K8S_DIR OUT_DIR
// For base and every overlay (following `resources:` and `components:` of each kustomization):
//   * every resource file as it is (base, components);
//   * configMapGenerator entries as ConfigMaps (files: key = file name, content = file text);
//   * the overlay's patches applied to the object they target: `path:` files as a strategic merge
//     (maps merged recursively, lists of named items such as containers merged by name, other
//     lists replaced, `$patch: delete` honoured) and inline JSON 6902 ops (add, replace, remove);
//   * `labels:` / `commonLabels:` added to metadata.labels.
// Not kustomize itself (no name hashes, no vars, no images edit beyond newName/newTag): what it
// must get right is every field that reaches the API server, which is what the schema check reads.
// Writes OUT_DIR/<name>.yaml per kustomization (base, overlay names).
'use strict';
const fs = require('fs');
const path = require('path');
const yaml = require('js-yaml');

const load = (f) => yaml.load(fs.readFileSync(f, 'utf8'));
const clone = (o) => JSON.parse(JSON.stringify(o));

function strategicMerge(target, patch) {
  if (Array.isArray(patch) || patch === null || typeof patch !== 'object') return clone(patch);
  if (target === null || typeof target !== 'object' || Array.isArray(target)) target = {};
  const out = { ...target };
  for (const [k, v] of Object.entries(patch)) {
    if (v && typeof v === 'object' && v.$patch === 'delete') { delete out[k]; continue; }
    if (v === null) { delete out[k]; continue; }
    if (Array.isArray(v) && Array.isArray(out[k]) && v.every((x) => x && x.name !== undefined)) {
      const merged = out[k].map(clone);
      for (const item of v) {
        const i = merged.findIndex((m) => m.name === item.name);
        if (i >= 0) merged[i] = strategicMerge(merged[i], item); else merged.push(clone(item));
      }
      out[k] = merged;
    } else {
      out[k] = strategicMerge(out[k], v);
    }
  }
  return out;
}

function jsonPatch(obj, ops, where) {
  for (const op of ops) {
    const keys = op.path.split('/').slice(1).map((s) => s.replace(/~1/g, '/').replace(/~0/g, '~'));
    const last = keys.pop();
    let parent = obj;
    for (const k of keys) {
      if (parent[k] === undefined) {
        if (op.op === 'add') parent[k] = {}; else throw new Error(`${where}: ${op.op} ${op.path}: no ${k}`);
      }
      parent = parent[k];
    }
    if (op.op === 'remove') {
      if (!(last in parent)) throw new Error(`${where}: remove ${op.path}: not there`);
      if (Array.isArray(parent)) parent.splice(Number(last), 1); else delete parent[last];
    } else if (op.op === 'replace' || op.op === 'add') {
      if (op.op === 'replace' && !(last in parent)) throw new Error(`${where}: replace ${op.path}: not there`);
      if (Array.isArray(parent) && op.op === 'add') {
        parent.splice(last === '-' ? parent.length : Number(last), 0, clone(op.value));
      } else parent[last] = clone(op.value);
    } else {
      throw new Error(`${where}: unsupported op ${op.op}`);
    }
  }
}

const matches = (obj, t) => (!t.kind || t.kind === obj.kind) && (!t.name || t.name === obj.metadata.name);

// The objects of the kustomization in dir.
function build(dir) {
  const k = load(path.join(dir, fs.existsSync(path.join(dir, 'kustomization.yaml')) ? 'kustomization.yaml' : 'kustomization.yml'));
  let objs = [];
  for (const r of k.resources || []) {
    const p = path.join(dir, r);
    if (fs.statSync(p).isDirectory()) objs.push(...build(p));
    else objs.push(...yaml.loadAll(fs.readFileSync(p, 'utf8')).filter(Boolean));
  }
  for (const c of k.components || []) objs.push(...build(path.join(dir, c)));
  for (const g of k.configMapGenerator || []) {
    const data = {};
    for (const f of g.files || []) {
      const [key, file] = f.includes('=') ? f.split('=') : [path.basename(f), f];
      data[key] = fs.readFileSync(path.join(dir, file), 'utf8');
    }
    for (const l of g.literals || []) { const i = l.indexOf('='); data[l.slice(0, i)] = l.slice(i + 1); }
    const cm = { apiVersion: 'v1', kind: 'ConfigMap', metadata: { name: g.name }, data };
    const i = objs.findIndex((o) => o.kind === 'ConfigMap' && o.metadata.name === g.name);
    if (g.behavior === 'replace' || g.behavior === 'merge') {
      if (i < 0) throw new Error(`${dir}: configMapGenerator ${g.behavior} of missing ${g.name}`);
      objs[i] = g.behavior === 'replace' ? cm : strategicMerge(objs[i], cm);
    } else objs.push(cm);
  }
  for (const p of k.patches || [])  {
    let body = p.path ? fs.readFileSync(path.join(dir, p.path), 'utf8') : p.patch;
    const doc = yaml.load(body);
    if (Array.isArray(doc)) {  // JSON 6902
      const hits = objs.filter((o) => matches(o, p.target || {}));
      if (!hits.length) throw new Error(`${dir}: patch target ${JSON.stringify(p.target)} matches nothing`);
      hits.forEach((o) => jsonPatch(o, doc, dir));
    } else {  // strategic merge
      const t = { kind: doc.kind, name: doc.metadata && doc.metadata.name, ...(p.target || {}) };
      const i = objs.findIndex((o) => matches(o, t));
      if (i < 0) throw new Error(`${dir}: patch ${p.path || '(inline)'} matches nothing`);
      objs[i] = strategicMerge(objs[i], doc);
    }
  }
  const labels = { ...(k.commonLabels || {}) };
  for (const l of k.labels || []) Object.assign(labels, l.pairs || {});
  if (Object.keys(labels).length) {
    objs = objs.map((o) => ({ ...o, metadata: { ...o.metadata, labels: { ...(o.metadata.labels || {}), ...labels } } }));
  }
  return objs;
}

const [k8s, out] = process.argv.slice(2);
fs.mkdirSync(out, { recursive: true });
const dirs = [path.join(k8s, 'base'), ...fs.readdirSync(path.join(k8s, 'overlays')).map((d) => path.join(k8s, 'overlays', d))];
for (const d of dirs) {
  const objs = build(d);
  const file = path.join(out, `${path.basename(d)}.yaml`);
  fs.writeFileSync(file, objs.map((o) => yaml.dump(o, { lineWidth: -1 })).join('---\n'));
  console.log(`${path.relative(k8s, d)}: ${objs.length} objects (${objs.map((o) => o.kind).join(', ')}) -> ${file}`);
}
