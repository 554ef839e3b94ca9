package config

import (
	"bytes"
	"errors"
	"fmt"
	goccy "github.com/goccy/go-yaml"
	goccyparser "github.com/goccy/go-yaml/parser"
	"io"
	"os"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"sync"

	"gopkg.in/yaml.v3"
)

// Sentinel causes of a FieldError, for errors.Is.
var (
	// ErrUnknownKey: the key is not part of the configuration format.
	ErrUnknownKey = errors.New("unknown key")
	// ErrDuplicateKey: the key appears twice in the same mapping.
	ErrDuplicateKey = errors.New("duplicate key")
	// ErrType: the value has the wrong YAML type (a sequence for a string, a string for a
	// number, ...).
	ErrType = errors.New("wrong type")
	// ErrInvalid: the value has the right type but is not allowed.
	ErrInvalid = errors.New("invalid value")
)

// FieldError is one problem with one configuration key. Load and Validate return one
// FieldError, or several joined with errors.Join.
type FieldError struct {
	// File is the configuration file name; empty for errors found by Validate.
	File string
	// Path is the full key path, e.g. "backends.pivirtd.timeout" or
	// "routing.rules[1].match.prefix"; empty for errors about the whole document.
	Path string
	// Line and Column locate the value in File (1-based); zero when unknown.
	Line, Column int
	// Err is the cause.
	Err error
}

// Error formats the error as "file: path: cause", leaving out empty parts.
func (e *FieldError) Error() string {
	var b strings.Builder
	if e.File != "" {
		b.WriteString(e.File)
		b.WriteString(": ")
	}
	if e.Path != "" {
		b.WriteString(e.Path)
		b.WriteString(": ")
	}
	b.WriteString(e.Err.Error())
	return b.String()
}

// Unwrap returns the cause.
func (e *FieldError) Unwrap() error { return e.Err }

// Load returns Default() with the YAML file at path on top. The file is read strictly: an
// unknown key, a duplicate key, a wrong type, a bad duration or a value outside an
// enumeration is an error naming the file and the full key path; all such problems are
// reported together. An empty file yields the defaults. Load does not call Validate.
func Load(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read config file: %w", err)
	}
	return Parse(data, path)
}

// Parse is Load for a file already in memory; name is used in error messages.
func Parse(data []byte, name string) (*Config, error) {
	cfg := Default()
	if err := decodeYAML(data, name, cfg); err != nil {
		return nil, err
	}
	return cfg, nil
}

// Limits that keep a hostile or broken file (alias bombs, huge lists of errors) cheap.
const (
	maxNodes  = 1 << 20
	maxErrors = 50
)

// YAML short tags.
const (
	nullTag  = "!!null"
	strTag   = "!!str"
	intTag   = "!!int"
	floatTag = "!!float"
	boolTag  = "!!bool"
	mergeTag = "!!merge"
)

// decodeYAML decodes one YAML document from data into out (a non-nil pointer) with the
// strict walker. Values the document does not mention keep what out already holds.
func decodeYAML(data []byte, file string, out any) error {
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var doc yaml.Node
	if err := dec.Decode(&doc); err != nil {
		if errors.Is(err, io.EOF) {
			return nil // empty file: defaults
		}
		return syntaxError(data, file, err)
	}
	var extra yaml.Node
	switch err := dec.Decode(&extra); {
	case err == nil:
		return &FieldError{File: file, Line: extra.Line, Column: extra.Column,
			Err: fmt.Errorf("multiple YAML documents (line %d): only one is allowed", extra.Line)}
	case !errors.Is(err, io.EOF):
		return syntaxError(data, file, err)
	}
	if doc.Kind != yaml.DocumentNode || len(doc.Content) != 1 {
		return nil
	}
	d := &walker{file: file, budget: maxNodes}
	root := doc.Content[0]
	if root.Kind == yaml.ScalarNode && root.ShortTag() == nullTag {
		return nil // a document of only comments, or "~"
	}
	d.value(root, reflect.ValueOf(out).Elem(), "")
	return errors.Join(d.errs...)
}

// syntaxError is a file yaml.v3 cannot parse. yaml.v3 reports the line
// where the enclosing mapping or sequence began (often the line above the
// mistake) and no column; goccy/go-yaml's parser points at the token
// itself and quotes the lines around it, so its position and excerpt are
// added when it finds a syntax error too, at or after yaml.v3's line (an
// earlier one would be goccy's own disagreement with yaml.v3). yaml.v3's
// message is kept. goccy is asked only here, about input yaml.v3 refused:
// a panic of its parser leaves yaml.v3's error alone (a reload must not
// take the agent down).
func syntaxError(data []byte, file string, err error) (out error) {
	out = &FieldError{File: file, Err: err}
	defer func() {
		if recover() != nil {
			out = &FieldError{File: file, Err: err}
		}
	}()
	_, perr := goccyparser.ParseBytes(data, 0)
	var se *goccy.SyntaxError
	if !errors.As(perr, &se) || se.Token == nil || se.Token.Position == nil {
		return out
	}
	pos := se.Token.Position
	if m := yamlLine.FindStringSubmatch(err.Error()); m != nil {
		if line, _ := strconv.Atoi(m[1]); pos.Line < line {
			return out
		}
	}
	return &FieldError{File: file, Line: pos.Line, Column: pos.Column,
		Err: fmt.Errorf("%w\nat %s", err, strings.TrimRight(goccy.FormatError(perr, false, true), "\n"))}
}

// yamlLine is the line number of a yaml.v3 syntax error ("yaml: line 3: …").
var yamlLine = regexp.MustCompile(`^yaml: line (\d+):`)

// walker decodes a yaml.Node tree into Go values by reflection, using the `yaml` struct tags,
// and records every problem with its key path. See DESIGN.md for why it exists.
type walker struct {
	file   string
	errs   []error
	budget int  // nodes left to visit; aliases can make a small file expand a lot
	full   bool // maxErrors reached or budget exhausted: stop recording
}

func (w *walker) fail(n *yaml.Node, path string, err error) {
	if w.full {
		return
	}
	if len(w.errs) == maxErrors {
		w.errs = append(w.errs, &FieldError{File: w.file, Err: errors.New("too many errors, giving up")})
		w.full = true
		return
	}
	fe := &FieldError{File: w.file, Path: path, Err: err}
	if n != nil {
		fe.Line, fe.Column = n.Line, n.Column
	}
	w.errs = append(w.errs, fe)
}

// step spends one unit of the node budget; false means stop walking.
func (w *walker) step(n *yaml.Node, path string) bool {
	if w.full {
		return false
	}
	w.budget--
	if w.budget < 0 {
		w.fail(n, path, errors.New("document too large or too many alias expansions"))
		w.full = true
		return false
	}
	return true
}

var unmarshalerType = reflect.TypeFor[yaml.Unmarshaler]()

// value decodes n into v, which must be settable.
func (w *walker) value(n *yaml.Node, v reflect.Value, path string) {
	if !w.step(n, path) {
		return
	}
	for i := 0; n.Kind == yaml.AliasNode; i++ {
		if n.Alias == nil || i > 100 {
			w.fail(n, path, fmt.Errorf("%w: unresolvable alias", ErrInvalid))
			return
		}
		n = n.Alias
	}
	if n.Tag != "" && n.Tag != "!" && !strings.HasPrefix(n.Tag, "!!") {
		w.fail(n, path, fmt.Errorf("%w: unsupported tag %q", ErrType, n.Tag))
		return
	}
	if n.Kind == yaml.ScalarNode && n.ShortTag() == nullTag {
		// As yaml.v3: null empties a map, slice or pointer and leaves anything else alone,
		// so "server:" with everything under it commented out keeps the defaults.
		switch v.Kind() {
		case reflect.Map, reflect.Slice, reflect.Pointer:
			v.SetZero()
		}
		return
	}
	if reflect.PointerTo(v.Type()).Implements(unmarshalerType) {
		if err := v.Addr().Interface().(yaml.Unmarshaler).UnmarshalYAML(n); err != nil {
			w.fail(n, path, err)
		}
		return
	}
	switch v.Kind() {
	case reflect.Pointer:
		if v.IsNil() {
			v.Set(reflect.New(v.Type().Elem()))
		}
		w.value(n, v.Elem(), path)
	case reflect.Struct:
		w.structure(n, v, path)
	case reflect.Map:
		w.mapping(n, v, path)
	case reflect.Slice:
		w.sequence(n, v, path)
	default:
		w.scalar(n, v, path)
	}
}

// field is one YAML key of a struct type.
type field struct {
	name  string
	index int
	enum  []string // allowed values; nil if any
}

var fieldCache sync.Map // reflect.Type → []field

// fieldsOf lists the YAML keys of struct type t in declaration order: exported fields named
// by their `yaml` tag (the lowercased field name without one), "-" skipped.
func fieldsOf(t reflect.Type) []field {
	if fs, ok := fieldCache.Load(t); ok {
		return fs.([]field)
	}
	var fs []field
	for i := range t.NumField() {
		sf := t.Field(i)
		if !sf.IsExported() {
			continue
		}
		name, _, _ := strings.Cut(sf.Tag.Get("yaml"), ",")
		if name == "-" {
			continue
		}
		if name == "" {
			name = strings.ToLower(sf.Name)
		}
		f := field{name: name, index: i}
		if e, ok := sf.Tag.Lookup("enum"); ok {
			f.enum = strings.Split(e, ",")
		}
		fs = append(fs, f)
	}
	fieldCache.Store(t, fs)
	return fs
}

// structure decodes a mapping into the struct v, key by key.
func (w *walker) structure(n *yaml.Node, v reflect.Value, path string) {
	if n.Kind != yaml.MappingNode {
		w.fail(n, path, fmt.Errorf("%w: expected a mapping, got %s", ErrType, describe(n)))
		return
	}
	fs := fieldsOf(v.Type())
	seen := make(map[string]int, len(n.Content)/2)
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, val := n.Content[i], n.Content[i+1]
		if !w.step(k, path) {
			return
		}
		key, ok := w.key(k, path, seen)
		if !ok {
			continue
		}
		kp := joinKey(path, key)
		var f *field
		for j := range fs {
			if fs[j].name == key {
				f = &fs[j]
				break
			}
		}
		if f == nil {
			names := make([]string, len(fs))
			for j := range fs {
				names[j] = fs[j].name
			}
			w.fail(k, kp, fmt.Errorf("%w (known: %s)", ErrUnknownKey, strings.Join(names, ", ")))
			continue
		}
		fv := v.Field(f.index)
		before := len(w.errs)
		w.value(val, fv, kp)
		if f.enum != nil && len(w.errs) == before {
			if err := checkEnum(fv.String(), f.enum); err != nil {
				w.fail(val, kp, err)
			}
		}
	}
}

// mapping decodes a mapping into the string-keyed map v; existing entries are decoded into,
// so a map of defaults is merged, as yaml.v3 does.
func (w *walker) mapping(n *yaml.Node, v reflect.Value, path string) {
	if n.Kind != yaml.MappingNode {
		w.fail(n, path, fmt.Errorf("%w: expected a mapping, got %s", ErrType, describe(n)))
		return
	}
	if v.Type().Key().Kind() != reflect.String {
		w.fail(n, path, fmt.Errorf("unsupported map key type %s", v.Type().Key()))
		return
	}
	if v.IsNil() {
		v.Set(reflect.MakeMapWithSize(v.Type(), len(n.Content)/2))
	}
	seen := make(map[string]int, len(n.Content)/2)
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, val := n.Content[i], n.Content[i+1]
		if !w.step(k, path) {
			return
		}
		key, ok := w.key(k, path, seen)
		if !ok {
			continue
		}
		kv := reflect.ValueOf(key).Convert(v.Type().Key())
		elem := reflect.New(v.Type().Elem()).Elem()
		if old := v.MapIndex(kv); old.IsValid() {
			elem.Set(old)
		}
		w.value(val, elem, joinKey(path, key))
		v.SetMapIndex(kv, elem)
	}
}

// key checks a mapping key node: a scalar, not a merge key, not seen before in this mapping.
func (w *walker) key(k *yaml.Node, path string, seen map[string]int) (string, bool) {
	for i := 0; k.Kind == yaml.AliasNode && k.Alias != nil && i < 100; i++ {
		k = k.Alias
	}
	if k.Kind != yaml.ScalarNode {
		w.fail(k, path, fmt.Errorf("%w: mapping keys must be strings, got %s", ErrType, describe(k)))
		return "", false
	}
	if k.ShortTag() == mergeTag {
		w.fail(k, joinKey(path, k.Value), fmt.Errorf("%w: merge keys (<<) are not supported", ErrInvalid))
		return "", false
	}
	if line, dup := seen[k.Value]; dup {
		w.fail(k, joinKey(path, k.Value), fmt.Errorf("%w (first defined on line %d)", ErrDuplicateKey, line))
		return "", false
	}
	seen[k.Value] = k.Line
	return k.Value, true
}

// sequence decodes a sequence into the slice v, replacing its contents.
func (w *walker) sequence(n *yaml.Node, v reflect.Value, path string) {
	if n.Kind != yaml.SequenceNode {
		w.fail(n, path, fmt.Errorf("%w: expected a sequence, got %s", ErrType, describe(n)))
		return
	}
	s := reflect.MakeSlice(v.Type(), len(n.Content), len(n.Content))
	for i, item := range n.Content {
		w.value(item, s.Index(i), path+"["+strconv.Itoa(i)+"]")
	}
	v.Set(s)
}

// scalar decodes a scalar node into a string, bool, integer or float. The YAML type must
// match: a quoted "3" is not an integer and an unquoted 3 is not a string.
func (w *walker) scalar(n *yaml.Node, v reflect.Value, path string) {
	if n.Kind != yaml.ScalarNode {
		w.fail(n, path, fmt.Errorf("%w: expected %s, got %s", ErrType, kindName(v.Kind()), describe(n)))
		return
	}
	tag := n.ShortTag()
	wrongType := func() {
		w.fail(n, path, fmt.Errorf("%w: expected %s, got %s", ErrType, kindName(v.Kind()), describe(n)))
	}
	switch v.Kind() {
	case reflect.String:
		if tag != strTag {
			wrongType()
			return
		}
		v.SetString(n.Value)
	case reflect.Bool:
		if tag != boolTag {
			wrongType()
			return
		}
		var b bool
		if err := n.Decode(&b); err != nil {
			w.fail(n, path, fmt.Errorf("%w: %w", ErrType, err))
			return
		}
		v.SetBool(b)
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		if tag != intTag {
			wrongType()
			return
		}
		var i int64
		if err := n.Decode(&i); err != nil || v.OverflowInt(i) {
			w.fail(n, path, fmt.Errorf("%w: integer %s out of range", ErrInvalid, n.Value))
			return
		}
		v.SetInt(i)
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		if tag != intTag {
			wrongType()
			return
		}
		var u uint64
		if err := n.Decode(&u); err != nil || v.OverflowUint(u) {
			if strings.HasPrefix(strings.TrimSpace(n.Value), "-") {
				w.fail(n, path, fmt.Errorf("%w: must not be negative, got %s", ErrInvalid, n.Value))
			} else {
				w.fail(n, path, fmt.Errorf("%w: integer %s out of range", ErrInvalid, n.Value))
			}
			return
		}
		v.SetUint(u)
	case reflect.Float32, reflect.Float64:
		if tag != floatTag && tag != intTag {
			wrongType()
			return
		}
		var f float64
		if err := n.Decode(&f); err != nil || v.OverflowFloat(f) {
			w.fail(n, path, fmt.Errorf("%w: number %s out of range", ErrInvalid, n.Value))
			return
		}
		v.SetFloat(f)
	default:
		w.fail(n, path, fmt.Errorf("unsupported Go type %s", v.Type()))
	}
}

// checkEnum reports whether s is one of allowed.
func checkEnum(s string, allowed []string) error {
	for _, a := range allowed {
		if s == a {
			return nil
		}
	}
	quoted := make([]string, len(allowed))
	for i, a := range allowed {
		if a == "" {
			a = `""`
		}
		quoted[i] = a
	}
	return fmt.Errorf("%w %q (allowed: %s)", ErrInvalid, s, strings.Join(quoted, ", "))
}

// joinKey appends a mapping key to a path: "a.b", or a["odd key"] for keys that are not
// plain identifiers.
func joinKey(path, key string) string {
	if !isIdent(key) {
		return path + "[" + strconv.Quote(key) + "]"
	}
	if path == "" {
		return key
	}
	return path + "." + key
}

func isIdent(s string) bool {
	if s == "" {
		return false
	}
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '_' || r == '-') {
			return false
		}
	}
	return true
}

// kindName names what a Go kind expects, for type errors.
func kindName(k reflect.Kind) string {
	switch k {
	case reflect.String:
		return "a string"
	case reflect.Bool:
		return "a boolean (true or false)"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return "an integer"
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return "a non-negative integer"
	case reflect.Float32, reflect.Float64:
		return "a number"
	default:
		return k.String()
	}
}

// describe names a node's YAML type and, for scalars, its value.
func describe(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a sequence"
	case yaml.AliasNode:
		return "an alias"
	case yaml.ScalarNode:
	default:
		return "a document"
	}
	v := n.Value
	if len(v) > 40 {
		v = v[:40] + "..."
	}
	switch n.ShortTag() {
	case strTag:
		return "string " + strconv.Quote(v)
	case intTag:
		return "integer " + v
	case floatTag:
		return "number " + v
	case boolTag:
		return "boolean " + v
	case nullTag:
		return "null"
	default:
		return fmt.Sprintf("%s %q", strings.TrimPrefix(n.ShortTag(), "!!"), v)
	}
}

// Decode decodes the YAML document data into out (a non-nil pointer to a
// struct) as Load reads the agent's configuration: strictly, every problem
// a FieldError naming file and the key path. Values the document does not
// mention keep what out holds, so out carries the defaults. Other
// programs' configuration files (pitrust serve's) use it.
func Decode(data []byte, file string, out any) error { return decodeYAML(data, file, out) }
