"""The Go-template renderer the chart tests use without helm: each case's expected output
is what Helm prints (checked against Helm itself wherever its SDK is installed)."""

from __future__ import annotations

import pytest
import yaml

from tests.deploy.chart import RenderError, available_renderers

# Templates of each case may include these.
DEFINES = """{{- define "pair" -}}
key: {{ .v }}
{{- end }}
{{- define "scoped" -}}{{ $.v }}/{{ .v }}{{- end }}
"""

VALUES = {
    "big": 17179869184,
    "small": 8100,
    "rate": 1.25,
    "million": 1000000,
    "tiny": 0.00001,
    "off": False,
    "on": True,
    "empty": "",
    "name": "catalog",
    "letters": ["a", "b"],
    "none": [],
    "map": {"b": 2, "a": {"z": [1, "x"]}},
}

# (id, template, expected output)
CASES = [
    ("trim markers", "a  {{- 1 -}}  \n b", "a1b"),
    ("comments", "a{{/* note */}}b {{- /* trimmed */ -}} c", "abc"),
    ("if else if", "{{ if .Values.off }}1{{ else if .Values.on }}2{{ else }}3{{ end }}", "2"),
    ("if else", "{{ if .Values.empty }}1{{ else }}3{{ end }}", "3"),
    (
        "range list",
        "{{ range $i, $v := .Values.letters }}{{ $i }}={{ $v }};{{ end }}",
        "0=a;1=b;",
    ),
    ("range map in key order", "{{ range $k, $v := .Values.map }}{{ $k }},{{ end }}", "a,b,"),
    ("range dot", "{{ range .Values.letters }}<{{ . }}>{{ end }}", "<a><b>"),
    ("range else", "{{ range .Values.none }}x{{ else }}none{{ end }}", "none"),
    ("with", "{{ with .Values.map.b }}{{ . }}{{ else }}-{{ end }}", "2"),
    ("with else", "{{ with .Values.empty }}{{ . }}{{ else }}-{{ end }}", "-"),
    ("include nindent", '{{- include "pair" (dict "v" 3) | nindent 2 }}', "\n  key: 3"),
    ("include sees its own $", '{{ include "scoped" (dict "v" "in") }}', "in/in"),
    ("variables", "{{ $a := 1 }}{{ if true }}{{ $a = 2 }}{{ end }}{{ $a }}", "2"),
    ("block-local variable", "{{ $a := 1 }}{{ if true }}{{ $a := 5 }}{{ end }}{{ $a }}", "1"),
    # Helm reads every number in values as a float64 and prints it with Go's %v.
    (
        "numbers",
        "{{ .Values.big }} {{ .Values.small }} {{ .Values.rate }} {{ .Values.million }} "
        "{{ .Values.tiny }}",
        "1.7179869184e+10 8100 1.25 1e+06 1e-05",
    ),
    (
        "int64 and quote",
        "{{ .Values.big | int64 | quote }} {{ .Values.small | quote }} {{ .Values.on | quote }}",
        '"17179869184" "8100" "true"',
    ),
    ("printf of a float with %d", '{{ printf "%d" .Values.small }}', "%!d(float64=8100)"),
    ("printf", '{{ printf "%s:%d" "port" (.Values.small | int64) }}', "port:8100"),
    ("parentheses", '{{ printf "%s-%s" (printf "a") ("b" | quote) }}', 'a-"b"'),
    ("toYaml", "{{ toYaml .Values.map }}", "a:\n  z:\n  - 1\n  - x\nb: 2"),
    ("toYaml empty", "{{ toYaml .Values.none }}", "[]"),
    ("missing key prints nothing", "[{{ .Values.nope }}]", "[]"),
    (
        "default",
        '{{ .Values.empty | default "d" }}|{{ 0 | default 5 }}|{{ "x" | default "d" }}',
        "d|5|x",
    ),
    (
        "contains",
        '{{ contains "cat" .Values.name }} {{ contains .Values.name "cat" }}',
        "true false",
    ),
    ("trunc trimSuffix", '{{ "abcde-x" | trunc 6 | trimSuffix "-" }}', "abcde"),
    ("div", "{{ div 95 10 }} {{ div (.Values.small | int64) 100 }}", "9 81"),
    ("print", '{{ print "a" 1 2 "b" }}', "a1 2b"),
    ("and or", '{{ and 1 0 }} {{ or 0 "" "z" }}', "0 z"),
    ("eq not", '{{ if and (eq .Values.name "catalog") (not .Values.off) }}ok{{ end }}', "ok"),
    ("sha256sum", '{{ "abc" | sha256sum | trunc 12 }}', "ba7816bf8f01"),
    ("list", '{{ range list "x" "y" }}{{ . }}{{ end }}', "xy"),
]

# (id, template, text the error must contain)
ERRORS = [
    ("field of nothing", "{{ .Values.nope.deeper }}", "nil pointer"),
    ("required", '{{ required "set nope" .Values.nope }}', "set nope"),
    ("required empty string", '{{ required "set empty" .Values.empty }}', "set empty"),
    ("unclosed if", "{{ if true }}x", "unexpected EOF"),
]

# The Go-template renderers that return raw text (`helm template` needs YAML output).
TEXT_RENDERERS = {name: r for name, r in available_renderers().items() if name != "helm"}


def render_case(renderer, tmp_path, template: str) -> str:
    chart = tmp_path / "case"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: case\nversion: 0.1.0\n")
    (chart / "values.yaml").write_text(yaml.safe_dump(VALUES))
    (chart / "templates" / "_defines.tpl").write_text(DEFINES)
    (chart / "templates" / "case.txt").write_text(template)
    return renderer(chart, {}).texts["case/templates/case.txt"]


@pytest.mark.parametrize("renderer", TEXT_RENDERERS.values(), ids=TEXT_RENDERERS)
@pytest.mark.parametrize(
    ("template", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_renders_as_helm_does(renderer, tmp_path, template, expected):
    assert render_case(renderer, tmp_path, template) == expected


@pytest.mark.parametrize("renderer", TEXT_RENDERERS.values(), ids=TEXT_RENDERERS)
@pytest.mark.parametrize(
    ("template", "message"), [c[1:] for c in ERRORS], ids=[c[0] for c in ERRORS]
)
def test_fails_where_helm_fails(renderer, tmp_path, template, message):
    with pytest.raises(RenderError, match=message):
        render_case(renderer, tmp_path, template)


def test_functions_outside_the_subset_are_refused(tmp_path):
    # Helm has `upper`; the subset renderer does not, so a chart using it fails loudly.
    with pytest.raises(RenderError, match="function 'upper' is not supported"):
        render_case(available_renderers()["subset"], tmp_path, "{{ upper .Values.name }}")
