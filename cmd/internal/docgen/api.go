package docgen

import (
	"bytes"
	"context"
	"fmt"
	"io/fs"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"unicode"

	"github.com/bufbuild/protocompile"
	"google.golang.org/protobuf/reflect/protoreflect"

	"pilab.hu/pivirt-agent/gateway/authz"
)

// APISection is a part of the API reference: the services one server
// serves, as the generated code it registers describes them.
type APISection struct {
	Title, Intro string
	Services     []protoreflect.ServiceDescriptor
	// RBAC says the server authorizes each method by its
	// pivirt.api.v1.authz annotation (the agent's gateway, which denies a
	// method without one): the reference shows each method's resource and
	// verb, and a method without the annotation is an error.
	RBAC bool
	// ByResource are the rows "| `resource` | `verb` | methods |" of the
	// section's index by RBAC grant, the view a policy's author reads
	// (none: no index).
	ByResource []string
}

// APIReference renders docs/api.md: the sections' services, and the
// messages and enums their methods take and return, from the .proto files
// under protoDir compiled with their comments (the generated Go carries
// no comments). The generated descriptors of the sections say which
// services a server has and give each method's authorization, as the
// gateway reads it; the .proto files must declare the same methods (else
// the generated code is stale). The .proto packages none of whose
// services or types are in a section are listed as left out, with the
// first sentence of their package comment.
func APIReference(protoDir string, sections ...APISection) ([]byte, error) {
	files, err := compileProtos(protoDir)
	if err != nil {
		return nil, err
	}
	r := newAPIRef(files)
	for _, s := range sections {
		for _, gen := range s.Services {
			sd, err := r.compiledService(gen)
			if err != nil {
				return nil, err
			}
			r.documentService(sd)
		}
	}
	var b bytes.Buffer
	r.writeIntro(&b, sections)
	for _, s := range sections {
		if err := r.writeSection(&b, s); err != nil {
			return nil, err
		}
	}
	if err := r.writeTypes(&b); err != nil {
		return nil, err
	}
	return tidyBlankLines(b.Bytes()), nil
}

// tidyBlankLines leaves one blank line between blocks, however the
// writers joined them, and one newline at the end.
func tidyBlankLines(page []byte) []byte {
	page = blankLinesRE.ReplaceAll(page, []byte("\n\n"))
	return append(bytes.TrimRight(page, "\n"), '\n')
}

var blankLinesRE = regexp.MustCompile(`\n{3,}`)

// compileProtos compiles every .proto file under dir (imports resolved
// there and among the well-known types) with its comments, in path order.
func compileProtos(dir string) ([]protoreflect.FileDescriptor, error) {
	var paths []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || filepath.Ext(p) != ".proto" {
			return err
		}
		rel, err := filepath.Rel(dir, p)
		paths = append(paths, filepath.ToSlash(rel))
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("the .proto files under %s: %w", dir, err)
	}
	if len(paths) == 0 {
		return nil, fmt.Errorf("no .proto file under %s", dir)
	}
	slices.Sort(paths)
	c := protocompile.Compiler{
		Resolver:       protocompile.WithStandardImports(&protocompile.SourceResolver{ImportPaths: []string{dir}}),
		SourceInfoMode: protocompile.SourceInfoStandard,
	}
	compiled, err := c.Compile(context.Background(), paths...)
	if err != nil {
		return nil, fmt.Errorf("compiling the .proto files under %s: %w", dir, err)
	}
	files := make([]protoreflect.FileDescriptor, len(compiled))
	for i, f := range compiled {
		files[i] = f
	}
	return files, nil
}

// apiRef is the reference being written: the compiled files and what of
// them is documented.
type apiRef struct {
	files []protoreflect.FileDescriptor
	// services are the files' services by name; documented the services
	// and types (messages, enums) of the reference.
	services   map[protoreflect.FullName]protoreflect.ServiceDescriptor
	documented map[protoreflect.FullName]bool
	// anchors are the headings' anchors written so far: a duplicate would
	// make GitHub number it and the links miss.
	anchors map[string]bool
}

func newAPIRef(files []protoreflect.FileDescriptor) *apiRef {
	r := &apiRef{files: files, services: map[protoreflect.FullName]protoreflect.ServiceDescriptor{},
		documented: map[protoreflect.FullName]bool{}, anchors: map[string]bool{}}
	for _, f := range files {
		for i := range f.Services().Len() {
			sd := f.Services().Get(i)
			r.services[sd.FullName()] = sd
		}
	}
	return r
}

// compiledService is the .proto files' service of the generated one gen,
// which must have the same methods.
func (r *apiRef) compiledService(gen protoreflect.ServiceDescriptor) (protoreflect.ServiceDescriptor, error) {
	sd, ok := r.services[gen.FullName()]
	if !ok {
		return nil, fmt.Errorf("service %s is in the generated code but in no .proto file: run make generate", gen.FullName())
	}
	if got, want := methodNames(sd), methodNames(gen); !slices.Equal(got, want) {
		return nil, fmt.Errorf("service %s has the methods %v in its .proto file but %v in the generated code: run make generate", sd.FullName(), got, want)
	}
	return sd, nil
}

func methodNames(sd protoreflect.ServiceDescriptor) []string {
	var out []string
	for i := range sd.Methods().Len() {
		out = append(out, string(sd.Methods().Get(i).Name()))
	}
	return out
}

// documentService marks sd and every message and enum its methods reach
// (through fields, map values included) as documented; the well-known
// types are not the reference's.
func (r *apiRef) documentService(sd protoreflect.ServiceDescriptor) {
	r.documented[sd.FullName()] = true
	var visit func(d protoreflect.Descriptor)
	visit = func(d protoreflect.Descriptor) {
		if d == nil || !r.local(d) || r.documented[d.FullName()] {
			return
		}
		md, ok := d.(protoreflect.MessageDescriptor)
		if !ok || !md.IsMapEntry() {
			r.documented[d.FullName()] = true
		}
		if !ok {
			return
		}
		for i := range md.Fields().Len() {
			f := md.Fields().Get(i)
			if f.Message() != nil {
				visit(f.Message())
			}
			if f.Enum() != nil {
				visit(f.Enum())
			}
		}
	}
	for i := range sd.Methods().Len() {
		m := sd.Methods().Get(i)
		visit(m.Input())
		visit(m.Output())
	}
}

// local says d is declared in a file under the proto directory.
func (r *apiRef) local(d protoreflect.Descriptor) bool {
	return slices.ContainsFunc(r.files, func(f protoreflect.FileDescriptor) bool { return f.Path() == d.ParentFile().Path() })
}

func (r *apiRef) writeIntro(b *bytes.Buffer, sections []APISection) {
	b.WriteString(`# API reference

The services of PiVirt's servers, with the messages and enums they take and return. This page is
generated (` + "`make docs`" + `) from the ` + "`.proto`" + ` files under ` + "`proto/`" + `, compiled with their comments,
and from the generated code the servers register, which gives each method's authorization; the
tests fail when it is stale. A method's path is ` + "`/<package>.<Service>/<Method>`" + `.

`)
	for _, s := range sections {
		fmt.Fprintf(b, "- [%s](#%s):", s.Title, githubAnchor(s.Title))
		for i, sd := range sortedServices(s.Services) {
			sep := ","
			if i == 0 {
				sep = ""
			}
			fmt.Fprintf(b, "%s [%s](#%s)", sep, sd.Name(), githubAnchor("`"+string(sd.FullName())+"`"))
		}
		b.WriteString("\n")
	}
	b.WriteString("- [Messages and enums](#messages-and-enums)\n")
	left := r.leftOut()
	if len(left) == 0 {
		return
	}
	b.WriteString("\nNot in this reference:\n\n")
	for _, l := range left {
		b.WriteString("- " + l + "\n")
	}
}

// leftOut are the packages none of whose services or types is documented,
// each with its services and the first sentence of its package comment,
// and the services left out of packages that are documented.
func (r *apiRef) leftOut() []string {
	var out []string
	for _, pkg := range r.packages() {
		var services, undocumented []string
		documented := false
		for _, f := range r.filesOf(pkg) {
			for i := range f.Services().Len() {
				sd := f.Services().Get(i)
				services = append(services, "`"+string(sd.Name())+"`")
				if !r.documented[sd.FullName()] {
					about := comment(sd)
					if about == "" {
						about = r.packageComment(pkg)
					}
					undocumented = append(undocumented, fmt.Sprintf("`%s`: %s", sd.FullName(), mdText(firstSentence(about))))
				}
			}
			documented = documented || r.documentsAnyOf(f)
		}
		if !documented {
			line := "`" + string(pkg) + "`"
			if len(services) > 0 {
				line += " (" + strings.Join(services, ", ") + ")"
			}
			out = append(out, line+": "+mdText(firstSentence(r.packageComment(pkg))))
			continue
		}
		out = append(out, undocumented...)
	}
	return out
}

// documentsAnyOf says a service, message or enum of f is documented.
func (r *apiRef) documentsAnyOf(f protoreflect.FileDescriptor) bool {
	found := false
	walkTypes(f, func(d protoreflect.Descriptor) { found = found || r.documented[d.FullName()] })
	for i := range f.Services().Len() {
		found = found || r.documented[f.Services().Get(i).FullName()]
	}
	return found
}

// packages are the packages of the files, sorted.
func (r *apiRef) packages() []protoreflect.FullName {
	var out []protoreflect.FullName
	for _, f := range r.files {
		out = append(out, f.Package())
	}
	slices.Sort(out)
	return slices.Compact(out)
}

func (r *apiRef) filesOf(pkg protoreflect.FullName) []protoreflect.FileDescriptor {
	var out []protoreflect.FileDescriptor
	for _, f := range r.files {
		if f.Package() == pkg {
			out = append(out, f)
		}
	}
	return out
}

// packageComment is the comment of pkg's package statements (one file of
// a package usually has it).
func (r *apiRef) packageComment(pkg protoreflect.FullName) string {
	var parts []string
	for _, f := range r.filesOf(pkg) {
		if c := cleanComment(f.SourceLocations().ByPath(protoreflect.SourcePath{2}).LeadingComments); c != "" && !slices.Contains(parts, c) {
			parts = append(parts, c)
		}
	}
	return strings.Join(parts, "\n\n")
}

func sortedServices(services []protoreflect.ServiceDescriptor) []protoreflect.ServiceDescriptor {
	return slices.SortedFunc(slices.Values(services), func(a, b protoreflect.ServiceDescriptor) int {
		return strings.Compare(string(a.FullName()), string(b.FullName()))
	})
}

// writeSection writes a section's services, sorted by name: each with its
// comment, a table of its methods and the comment of each method.
func (r *apiRef) writeSection(b *bytes.Buffer, s APISection) error {
	if err := r.heading(b, 2, s.Title); err != nil {
		return err
	}
	b.WriteString(s.Intro + "\n")
	for _, gen := range sortedServices(s.Services) {
		if err := r.writeService(b, s, gen); err != nil {
			return err
		}
	}
	if len(s.ByResource) > 0 {
		if err := r.heading(b, 3, "By resource"); err != nil {
			return err
		}
		b.WriteString("What each grant of an RBAC policy lets its roles call: the resource and verb of a rule, and the methods they open.\n\n")
		b.WriteString("| resource | verb | methods |\n|---|---|---|\n")
		for _, row := range s.ByResource {
			b.WriteString(row + "\n")
		}
		b.WriteString("\n")
	}
	return nil
}

func (r *apiRef) writeService(b *bytes.Buffer, s APISection, gen protoreflect.ServiceDescriptor) error {
	sd := r.services[gen.FullName()]
	if err := r.heading(b, 3, "`"+string(sd.FullName())+"`"); err != nil {
		return err
	}
	writeBlock(b, comment(sd))
	b.WriteString("| method | request | response | streaming |")
	if s.RBAC {
		b.WriteString(" RBAC |\n|---|---|---|---|---|\n")
	} else {
		b.WriteString("\n|---|---|---|---|\n")
	}
	var described []protoreflect.MethodDescriptor
	for i := range sd.Methods().Len() {
		m := sd.Methods().Get(i)
		name := string(m.Name())
		if comment(m) != "" {
			described = append(described, m)
			name = fmt.Sprintf("[%s](#%s)", name, githubAnchor(methodHeading(m)))
		}
		fmt.Fprintf(b, "| %s | %s | %s | %s |", name, r.typeLink(m.Input(), sd.ParentFile().Package()), r.typeLink(m.Output(), sd.ParentFile().Package()), streaming(m))
		if s.RBAC {
			rule, err := authz.MethodRule(gen.Methods().Get(i))
			if err != nil {
				return err
			}
			fmt.Fprintf(b, " %s |", rbacCell(rule.GetSelf(), rule.GetResource(), rule.GetVerb()))
		}
		b.WriteString("\n")
	}
	for _, m := range described {
		if err := r.heading(b, 4, methodHeading(m)); err != nil {
			return err
		}
		writeBlock(b, comment(m))
	}
	return nil
}

func methodHeading(m protoreflect.MethodDescriptor) string {
	return "`" + string(m.Parent().Name()) + "." + string(m.Name()) + "`"
}

func streaming(m protoreflect.MethodDescriptor) string {
	switch {
	case m.IsStreamingClient() && m.IsStreamingServer():
		return "bidirectional"
	case m.IsStreamingClient():
		return "client stream"
	case m.IsStreamingServer():
		return "server stream"
	}
	return "unary"
}

// rbacCell is what a method needs of the caller: the resource and verb of
// an RBAC rule, or only to be authenticated (self: it answers about the
// caller only).
func rbacCell(self bool, resource, verb string) string {
	if self {
		return "self"
	}
	return "`" + resource + "` `" + verb + "`"
}

// writeTypes writes the documented messages and enums, by package (sorted),
// in the order their files declare them.
func (r *apiRef) writeTypes(b *bytes.Buffer) error {
	if err := r.heading(b, 2, "Messages and enums"); err != nil {
		return err
	}
	for _, pkg := range r.packages() {
		var types []protoreflect.Descriptor
		for _, f := range r.filesOf(pkg) {
			walkTypes(f, func(d protoreflect.Descriptor) {
				if r.documented[d.FullName()] {
					types = append(types, d)
				}
			})
		}
		if len(types) == 0 {
			continue
		}
		if err := r.heading(b, 3, "`"+string(pkg)+"`"); err != nil {
			return err
		}
		writeBlock(b, r.packageComment(pkg))
		for _, d := range types {
			if err := r.writeType(b, d); err != nil {
				return err
			}
		}
	}
	return nil
}

// walkTypes calls fn with each message and enum of f, nested ones after
// their parent, in declaration order.
func walkTypes(f protoreflect.FileDescriptor, fn func(protoreflect.Descriptor)) {
	var walk func(msgs protoreflect.MessageDescriptors, enums protoreflect.EnumDescriptors)
	walk = func(msgs protoreflect.MessageDescriptors, enums protoreflect.EnumDescriptors) {
		for i := range enums.Len() {
			fn(enums.Get(i))
		}
		for i := range msgs.Len() {
			m := msgs.Get(i)
			fn(m)
			walk(m.Messages(), m.Enums())
		}
	}
	walk(f.Messages(), f.Enums())
}

func (r *apiRef) writeType(b *bytes.Buffer, d protoreflect.Descriptor) error {
	if err := r.heading(b, 4, "`"+string(d.FullName())+"`"); err != nil {
		return err
	}
	writeBlock(b, comment(d))
	switch d := d.(type) {
	case protoreflect.MessageDescriptor:
		r.writeFields(b, d)
	case protoreflect.EnumDescriptor:
		writeEnumValues(b, d)
	}
	return nil
}

func (r *apiRef) writeFields(b *bytes.Buffer, md protoreflect.MessageDescriptor) {
	if md.Fields().Len() == 0 {
		b.WriteString("No fields.\n")
		return
	}
	b.WriteString("| field | number | type | description |\n|---|---|---|---|\n")
	for i := range md.Fields().Len() {
		f := md.Fields().Get(i)
		fmt.Fprintf(b, "| `%s` | %d | %s | %s |\n", f.Name(), f.Number(), r.fieldType(f), cellText(comment(f)))
	}
}

func writeEnumValues(b *bytes.Buffer, ed protoreflect.EnumDescriptor) {
	b.WriteString("| value | number | description |\n|---|---|---|\n")
	for i := range ed.Values().Len() {
		v := ed.Values().Get(i)
		fmt.Fprintf(b, "| `%s` | %d | %s |\n", v.Name(), v.Number(), cellText(comment(v)))
	}
}

// fieldType is a field's type as the .proto file writes it, messages and
// enums linked: "repeated", "optional", "map from K to V", "(oneof o)".
func (r *apiRef) fieldType(f protoreflect.FieldDescriptor) string {
	pkg := f.ParentFile().Package()
	var t string
	switch {
	case f.IsMap():
		t = "map from " + r.valueType(f.MapKey(), pkg) + " to " + r.valueType(f.MapValue(), pkg)
	case f.IsList():
		t = "repeated " + r.valueType(f, pkg)
	case f.HasOptionalKeyword():
		t = "optional " + r.valueType(f, pkg)
	default:
		t = r.valueType(f, pkg)
	}
	if o := f.ContainingOneof(); o != nil && !o.IsSynthetic() {
		t += " (oneof `" + string(o.Name()) + "`)"
	}
	return t
}

// valueType is the type of one value of f: a scalar's name, or the
// message or enum linked.
func (r *apiRef) valueType(f protoreflect.FieldDescriptor, pkg protoreflect.FullName) string {
	switch {
	case f.Message() != nil:
		return r.typeLink(f.Message(), pkg)
	case f.Enum() != nil:
		return r.typeLink(f.Enum(), pkg)
	}
	return "`" + f.Kind().String() + "`"
}

// typeLink names a message or enum, relative to pkg when it is pkg's, with
// a link to it when the reference documents it.
func (r *apiRef) typeLink(d protoreflect.Descriptor, pkg protoreflect.FullName) string {
	name := string(d.FullName())
	if d.ParentFile().Package() == pkg {
		name = strings.TrimPrefix(name, string(pkg)+".")
	}
	if !r.documented[d.FullName()] {
		return "`" + name + "`"
	}
	return fmt.Sprintf("[`%s`](#%s)", name, githubAnchor("`"+string(d.FullName())+"`"))
}

// heading writes a heading, which must have an anchor of its own.
func (r *apiRef) heading(b *bytes.Buffer, level int, text string) error {
	a := githubAnchor(text)
	if r.anchors[a] {
		return fmt.Errorf("two headings of the API reference have the anchor #%s (the second: %s)", a, text)
	}
	r.anchors[a] = true
	fmt.Fprintf(b, "\n%s %s\n\n", strings.Repeat("#", level), text)
	return nil
}

// githubAnchor is the anchor GitHub gives a heading: lower case, without
// punctuation but hyphens and underscores, spaces as hyphens.
func githubAnchor(heading string) string {
	var b strings.Builder
	for _, c := range strings.ToLower(heading) {
		switch {
		case unicode.IsLetter(c) || unicode.IsDigit(c) || c == '-' || c == '_':
			b.WriteRune(c)
		case c == ' ':
			b.WriteRune('-')
		}
	}
	return b.String()
}

// comment is d's leading comment in its .proto file, else its trailing
// one, without the comment markers' indentation.
func comment(d protoreflect.Descriptor) string {
	loc := d.ParentFile().SourceLocations().ByDescriptor(d)
	if c := cleanComment(loc.LeadingComments); c != "" {
		return c
	}
	return cleanComment(loc.TrailingComments)
}

// cleanComment drops the space after each line's "//" and the blank lines
// around the text.
func cleanComment(c string) string {
	lines := strings.Split(c, "\n")
	for i, l := range lines {
		lines[i] = strings.TrimRight(strings.TrimPrefix(l, " "), " \t")
	}
	return strings.Trim(strings.Join(lines, "\n"), "\n")
}

// writeBlock writes a comment as paragraphs, escaped.
func writeBlock(b *bytes.Buffer, c string) {
	if c == "" {
		return
	}
	lines := strings.Split(c, "\n")
	for i, l := range lines {
		lines[i] = mdText(l)
	}
	b.WriteString(strings.Join(lines, "\n") + "\n\n")
}

// cellText is a comment on one line of a table: its lines joined,
// paragraphs apart.
func cellText(c string) string {
	var paras []string
	for _, p := range strings.Split(c, "\n\n") {
		paras = append(paras, mdText(strings.Join(strings.Fields(p), " ")))
	}
	return strings.Join(paras, "<br>")
}

// firstSentence is c up to its first full stop, on one line.
func firstSentence(c string) string {
	c = strings.Join(strings.Fields(c), " ")
	if i := strings.Index(c, ". "); i >= 0 {
		return c[:i+1]
	}
	return c
}
