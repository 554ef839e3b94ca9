#!/usr/bin/env bash
# Checks the repository's documents (the top-level DESIGN.md, "Documents"):
# every citation of a DESIGN.md section names a heading that exists in the
# document it means, and no file refers to documents outside the repository.
#
# A citation is <dir>/DESIGN.md, "<heading>" or <dir> DESIGN.md "<heading>"
# (that directory's), top-level DESIGN.md, "<heading>", or a bare
# DESIGN.md "<heading>" (the name may be in backticks, the heading in
# parentheses; a heading starts with a capital letter): in a DESIGN.md or the
# README it means the top-level one, in code or a script the nearest
# DESIGN.md at or above the file. Citations may span comment lines.
set -euo pipefail
cd "$(dirname "$0")/.."

git ls-files -z -- ':!node_modules' ':!package-lock.json' ':!*.pb.go' ':!*.connect.go' |
  perl -0 -ne '
    BEGIN { $fail = 0; %headings = () }
    chomp; my $file = $_;
    next unless -f $file && -T $file;
    local $/ = "\n";
    open(my $fh, "<", $file) or die "$file: $!";
    my @lines = <$fh>; close $fh;
    # Documents outside the repository.
    for my $i (0 .. $#lines) {
      if ($lines[$i] =~ m{(\bspec/[\w.-]+\.txt|\.\./shared\b)}) {
        print "docs check: $file:" . ($i + 1) . ": refers to $1, which is not in the repository\n";
        $fail = 1;
      }
    }
    # Citations: comment leaders and line breaks folded into spaces.
    my $text = join("", @lines);
    $text =~ s{\n[ \t]*(?://+|#+)?[ \t]*}{ }g;
    (my $dir = $file) =~ s{/?[^/]*$}{};
    my $base = ($file =~ m{([^/]+)$})[0];
    while ($text =~ m{(?:\b(top-level)\s+|`?([A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)*)/|\b([a-z][a-z0-9_]*(?:/[a-z0-9_]+)*)\s+)?`?DESIGN\.md`?,?\s*\(?\s*"([A-Z][^"\$\\]{0,80})"}g) {
      my ($top, $path, $word, $section) = ($1, $2, $3, $4);
      my $doc;
      if ($top) {
        $doc = "DESIGN.md";
      } elsif (defined $path) {
        $doc = -f "$path/DESIGN.md" ? "$path/DESIGN.md" : ($dir ne "" && -f "$dir/$path/DESIGN.md") ? "$dir/$path/DESIGN.md" : "$path/DESIGN.md";
      } elsif (defined $word && -f "$word/DESIGN.md") {
        $doc = "$word/DESIGN.md";
      } elsif ($base eq "DESIGN.md" || $base eq "README.md") {
        $doc = "DESIGN.md";
      } else {
        my $d = $dir;
        while (1) {
          my $cand = $d eq "" ? "DESIGN.md" : "$d/DESIGN.md";
          if (-f $cand) { $doc = $cand; last }
          last if $d eq "";
          $d =~ s{/?[^/]*$}{};
        }
      }
      if (!defined $doc || !-f $doc) {
        print "docs check: $file cites \"$section\" of " . ($doc // "a DESIGN.md") . ", which does not exist\n";
        $fail = 1;
        next;
      }
      if (!exists $headings{$doc}) {
        open(my $dh, "<", $doc) or die "$doc: $!";
        my %h; my $fence = 0;
        while (my $l = <$dh>) {
          $fence = !$fence if $l =~ /^```/;
          next if $fence;
          $h{$1} = 1 if $l =~ /^#{1,6}\s+(.+?)\s*$/;
        }
        close $dh;
        $headings{$doc} = \%h;
      }
      if (!$headings{$doc}{$section}) {
        print "docs check: $file cites section \"$section\" of $doc, which has no such heading\n";
        $fail = 1;
      }
    }
    END {
      if ($fail) { exit 1 }
      print "docs check: ok\n";
    }
  '
