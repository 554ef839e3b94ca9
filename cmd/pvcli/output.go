package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"
	"gopkg.in/yaml.v3"
)

// maxValueWidth is where table cells holding configuration values are cut.
const maxValueWidth = 40

// render writes msg in the --output format; table writes the table form.
func (a *app) render(msg proto.Message, table func(w io.Writer)) error {
	switch a.opts.output.value {
	case "json":
		b, err := marshalJSON(msg)
		if err != nil {
			return err
		}
		_, err = a.stdout.Write(b)
		return err
	case "yaml":
		b, err := marshalYAML(msg)
		if err != nil {
			return err
		}
		_, err = a.stdout.Write(b)
		return err
	default:
		tw := tabwriter.NewWriter(a.stdout, 0, 4, 3, ' ', 0)
		table(tw)
		return tw.Flush()
	}
}

// renderValue writes v, a value of plain Go types, in the --output format
// (JSON through encoding/json, YAML converted from that JSON); table writes
// the table form.
func (a *app) renderValue(v any, table func(w io.Writer)) error {
	switch a.opts.output.value {
	case "json", "yaml":
		var buf bytes.Buffer
		enc := json.NewEncoder(&buf)
		enc.SetEscapeHTML(false) // as protojson: "<" stays "<"
		enc.SetIndent("", "  ")
		if err := enc.Encode(v); err != nil {
			return err
		}
		b := buf.Bytes()
		if a.opts.output.value == "yaml" {
			var err error
			if b, err = jsonToYAML(b); err != nil {
				return err
			}
		}
		_, err := a.stdout.Write(b)
		return err
	default:
		tw := tabwriter.NewWriter(a.stdout, 0, 4, 3, ' ', 0)
		table(tw)
		return tw.Flush()
	}
}

// marshalJSON is protojson without unpopulated fields, indented by two
// spaces and ending with a newline.
func marshalJSON(msg proto.Message) ([]byte, error) {
	b, err := protojson.Marshal(msg)
	if err != nil {
		return nil, fmt.Errorf("encode %s as JSON: %w", msg.ProtoReflect().Descriptor().FullName(), err)
	}
	// protojson varies its whitespace on purpose (from one build to
	// another); scripts may compare outputs: indent it ourselves.
	var buf bytes.Buffer
	if err := json.Indent(&buf, b, "", "  "); err != nil {
		return nil, fmt.Errorf("encode %s as JSON: %w", msg.ProtoReflect().Descriptor().FullName(), err)
	}
	return append(buf.Bytes(), '\n'), nil
}

// marshalJSONLine is protojson on one line with no whitespace, ending with
// a newline: one event of a stream (NDJSON).
func marshalJSONLine(msg proto.Message) ([]byte, error) {
	b, err := protojson.Marshal(msg)
	if err != nil {
		return nil, fmt.Errorf("encode %s as JSON: %w", msg.ProtoReflect().Descriptor().FullName(), err)
	}
	var buf bytes.Buffer
	if err := json.Compact(&buf, b); err != nil {
		return nil, fmt.Errorf("encode %s as JSON: %w", msg.ProtoReflect().Descriptor().FullName(), err)
	}
	return append(buf.Bytes(), '\n'), nil
}

// marshalYAML converts the protojson form to YAML, keeping the field order
// and the JSON mapping's value forms (enum names, 64-bit integers as
// strings, "1.5s" durations, RFC 3339 timestamps).
func marshalYAML(msg proto.Message) ([]byte, error) {
	js, err := protojson.Marshal(msg)
	if err != nil {
		return nil, fmt.Errorf("encode %s as JSON: %w", msg.ProtoReflect().Descriptor().FullName(), err)
	}
	return jsonToYAML(js)
}

// jsonToYAML converts a JSON document to block-style YAML in the same
// key order.
func jsonToYAML(js []byte) ([]byte, error) {
	var doc yaml.Node
	if err := yaml.Unmarshal(js, &doc); err != nil {
		return nil, fmt.Errorf("convert JSON to YAML: %w", err)
	}
	blockStyle(&doc)
	var buf bytes.Buffer
	enc := yaml.NewEncoder(&buf)
	enc.SetIndent(2)
	if err := enc.Encode(&doc); err != nil {
		return nil, fmt.Errorf("encode YAML: %w", err)
	}
	if err := enc.Close(); err != nil {
		return nil, fmt.Errorf("encode YAML: %w", err)
	}
	return buf.Bytes(), nil
}

// blockStyle drops the flow and quoting styles the JSON input left on the
// nodes; the encoder quotes where plain style would change a value's type.
func blockStyle(n *yaml.Node) {
	n.Style = 0
	for _, c := range n.Content {
		blockStyle(c)
	}
}

func row(w io.Writer, cells ...string) {
	for i, c := range cells {
		if c == "" {
			cells[i] = "-"
		}
	}
	fmt.Fprintln(w, strings.Join(cells, "\t"))
}

// enumName is the value name without the type prefix, lower case
// (MEMBER_STATUS_ALIVE -> alive); empty for the zero value.
func enumName(e protoreflect.Enum) string {
	if e.Number() == 0 {
		return ""
	}
	d := e.Descriptor().Values().ByNumber(e.Number())
	if d == nil {
		return strconv.Itoa(int(e.Number()))
	}
	return strings.ToLower(trimEnumPrefix(e.Descriptor().Name(), string(d.Name())))
}

// trimEnumPrefix removes the SCREAMING_SNAKE_CASE form of the enum type name
// (the buf style prefix) from a value name.
func trimEnumPrefix(typeName protoreflect.Name, value string) string {
	var b strings.Builder
	for i, r := range string(typeName) {
		if i > 0 && r >= 'A' && r <= 'Z' {
			b.WriteByte('_')
		}
		b.WriteRune(r)
	}
	return strings.TrimPrefix(value, strings.ToUpper(b.String())+"_")
}

func formatUint(v uint64) string { return strconv.FormatUint(v, 10) }

func formatDuration(d *durationpb.Duration) string {
	if d == nil || d.AsDuration() == 0 {
		return ""
	}
	v := d.AsDuration()
	if v >= time.Millisecond {
		v = v.Round(time.Millisecond)
	}
	return v.String()
}

func formatTime(t *timestamppb.Timestamp) string {
	if t == nil {
		return ""
	}
	return t.AsTime().UTC().Format(time.RFC3339)
}

// truncate shows a value on one line: whitespace runs become one space and
// the result is cut at maxValueWidth characters.
func truncate(s string) string {
	s = strings.Join(strings.Fields(s), " ")
	if utf8.RuneCountInString(s) <= maxValueWidth {
		return s
	}
	r := []rune(s)
	return string(r[:maxValueWidth-3]) + "..."
}

// unavailableNodesHeader is the response header in which a cluster-wide
// list or watch names the nodes it could not reach
// (mesh.UnavailableNodesHeader).
const unavailableNodesHeader = "Pivirt-Unavailable-Nodes"

// warnUnavailable prints, once per node, a warning that an answer lacks the
// objects of the nodes its header names, rather than showing less in
// silence.
func (a *app) warnUnavailable(h http.Header) {
	for _, n := range h.Values(unavailableNodesHeader) {
		if a.warned == nil {
			a.warned = map[string]bool{}
		}
		if a.warned[n] {
			continue
		}
		a.warned[n] = true
		fmt.Fprintf(a.stderr, "Warning: the objects of a node that did not answer are not shown (%s)\n", n)
	}
}
