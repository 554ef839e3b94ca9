package config

import (
	"fmt"
	"reflect"
	"strings"
)

// LiveKeys are the keys (and key prefixes) a running agent applies without
// a restart, from its file (POST /reload, SIGHUP) or as cluster settings.
var LiveKeys = []string{"logging.level", "logging.components", "routing", "backends", "load_balancing", "circuit_breaking", "rate_limiting", "auth.certificate_roles", "pinned_settings", "service_discovery.services_dir", "tls.revocation", "server.ui"}

// RefRow is one row of the configuration reference.
type RefRow struct {
	// Key is the key path; "<name>" stands for a map key, "[]" for a list
	// item.
	Key, Type, Default string
	// Live: applied without a restart.
	Live bool
	// Setting: also a cluster setting (the cluster's value applies unless
	// the file pins it); Document: the setting holds the document the file
	// key names (a policy's text, not its path).
	Setting, Document bool
}

// Reference lists every key of the file, from the Config type and
// Default(): its type, default, whether it changes live and whether it is
// a cluster setting. docs/configuration.md is generated from it.
func Reference() []RefRow {
	var rows []RefRow
	def := reflect.ValueOf(Default()).Elem()
	var walk func(t reflect.Type, v reflect.Value, path string)
	walk = func(t reflect.Type, v reflect.Value, path string) {
		for _, f := range fieldsOf(t) {
			p := joinKey(path, f.name)
			ft := t.Field(f.index).Type
			var fv reflect.Value
			if v.IsValid() {
				fv = v.Field(f.index)
			}
			switch {
			case ft.Kind() == reflect.Struct && ft != reflect.TypeFor[Duration]():
				walk(ft, fv, p)
			case ft.Kind() == reflect.Map && ft.Elem().Kind() == reflect.Struct:
				rows = append(rows, row(p, ft, fv, f.enum))
				walk(ft.Elem(), reflect.Value{}, p+".<name>")
			case ft.Kind() == reflect.Slice && ft.Elem().Kind() == reflect.Struct:
				rows = append(rows, row(p, ft, fv, f.enum))
				walk(ft.Elem(), reflect.Value{}, p+"[]")
			default:
				rows = append(rows, row(p, ft, fv, f.enum))
			}
		}
	}
	walk(typeOfConfig, def, "")
	return rows
}

func row(path string, t reflect.Type, v reflect.Value, enum []string) RefRow {
	r := RefRow{Key: path, Type: typeName(t, enum)}
	if v.IsValid() && !v.IsZero() {
		switch x := v.Interface().(type) {
		case Duration:
			r.Default = x.String()
		case []string:
			r.Default = "[" + strings.Join(x, ", ") + "]"
		default:
			if v.Kind() != reflect.Map && v.Kind() != reflect.Slice {
				r.Default = fmt.Sprint(x)
			}
		}
	}
	if path == "node_name" {
		r.Default = "the host name"
	}
	for _, k := range LiveKeys {
		if Under(strings.ReplaceAll(path, "[]", ""), k) {
			r.Live = true
		}
	}
	for _, s := range Settings {
		if path == s.Key || strings.HasPrefix(path, s.Key+".") || strings.HasPrefix(path, s.Key+"[]") {
			r.Setting, r.Document = true, s.Document
			if s.Document {
				r.Type = "file path"
			}
		}
	}
	return r
}

func typeName(t reflect.Type, enum []string) string {
	if len(enum) > 0 {
		var vals []string
		for _, e := range enum {
			if e == "" {
				e = `""`
			}
			vals = append(vals, e)
		}
		return strings.Join(vals, " \\| ")
	}
	switch {
	case t == reflect.TypeFor[Duration]():
		return "duration"
	case t.Kind() == reflect.Slice && t.Elem().Kind() == reflect.Struct:
		return "list"
	case t.Kind() == reflect.Slice:
		return "list of " + typeName(t.Elem(), nil)
	case t.Kind() == reflect.Map && t.Elem().Kind() == reflect.Struct:
		return "map"
	case t.Kind() == reflect.Map:
		return "map of " + typeName(t.Elem(), nil)
	case t.Kind() == reflect.Float64:
		return "number"
	case t.Kind() == reflect.Int || t.Kind() == reflect.Uint64:
		return "integer"
	}
	return t.Kind().String()
}

// ReferenceMarkdown is Reference as the table of docs/configuration.md.
func ReferenceMarkdown() string {
	var b strings.Builder
	b.WriteString("| key | type | default | live | cluster setting |\n|---|---|---|---|---|\n")
	for _, r := range Reference() {
		live, setting := "restart", ""
		if r.Live {
			live = "live"
		}
		switch {
		case r.Document:
			setting = "yes (the file's text)"
			live = "live (the file's text)"
		case r.Setting:
			setting = "yes"
		}
		def := r.Default
		if def != "" {
			def = "`" + def + "`"
		}
		fmt.Fprintf(&b, "| `%s` | %s | %s | %s | %s |\n", r.Key, r.Type, def, live, setting)
	}
	return b.String()
}

// SettingsMarkdown is the table of the cluster settings in
// docs/configuration.md.
func SettingsMarkdown() string {
	var b strings.Builder
	b.WriteString("| key | value | changes |\n|---|---|---|\n")
	for _, s := range Settings {
		value := "YAML of the key, as in the file"
		if s.Document {
			value = "a document of its own"
		}
		fmt.Fprintf(&b, "| `%s` | %s | %s |\n", s.Key, value, s.Doc)
	}
	return b.String()
}

// ConfigurationDoc is docs/configuration.md: the reference of every key of
// the configuration file and of the cluster settings.
func ConfigurationDoc() string {
	var b strings.Builder
	b.WriteString(`# Configuration reference

pivirt-agent reads one YAML file (` + "`--config`" + `); flags override its keys. This page is generated
from the configuration's types and defaults (` + "`make docs`" + `); the other pages of the
guide ([README.md](README.md)) explain what the keys do.

- **live**: the key changes with ` + "`POST /reload`" + ` on the operations port or SIGHUP; the others need
  a restart.
- **cluster setting**: the key can also be set for every agent at once with
  ` + "`pvcli config set KEY VALUE`" + ` (the value is the YAML of the key, as in the file); a node's
  ` + "`pinned_settings`" + ` keep its own value.
- Keys that name policy files (` + "`auth.rbac_policy`" + `, ` + "`auth.network_policy`" + `) reload the file's text live.

## Keys

`)
	b.WriteString(ReferenceMarkdown())
	b.WriteString("\n## Cluster settings\n\n")
	b.WriteString(SettingsMarkdown())
	return b.String()
}
