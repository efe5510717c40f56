#!/usr/bin/env node
// Lints a Dockerfile with dockerfile-utils (the validator behind the VS Code Docker extension).
//   node lint-dockerfile.js <Dockerfile>
// Exits 1 on any error or warning.
'use strict';
const fs = require('fs');
const { validate, ValidationSeverity } = require('dockerfile-utils');

const file = process.argv[2];
const text = fs.readFileSync(file, 'utf8');
// Every rule at its default severity except these, raised to errors.
const diags = validate(text, {
  deprecatedMaintainer: ValidationSeverity.ERROR,
  directiveCasing: ValidationSeverity.ERROR,
  emptyContinuationLine: ValidationSeverity.ERROR,
  instructionCasing: ValidationSeverity.ERROR,
  instructionCmdMultiple: ValidationSeverity.ERROR,
  instructionEntrypointMultiple: ValidationSeverity.ERROR,
  instructionHealthcheckMultiple: ValidationSeverity.ERROR,
  instructionJSONInSingleQuotes: ValidationSeverity.ERROR,
  instructionWorkdirRelative: ValidationSeverity.ERROR,
});
for (const d of diags) {
  const sev = d.severity === 1 ? 'error' : d.severity === 2 ? 'warning' : 'info';
  console.error(`${file}:${d.range.start.line + 1}:${d.range.start.character + 1}: ${sev}: ${d.message}`);
}
const bad = diags.filter((d) => d.severity <= 2).length;
console.log(`${file}: ${diags.length} diagnostics, ${bad} errors/warnings`);
process.exit(bad ? 1 : 0);
